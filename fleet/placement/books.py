"""A placement pass's books: what each node has left while replicas are placed on it, and how a replica is stopped."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from ..snapshots import NodeView, Plan, ReplicaView


@dataclass
class Room:
    """What is left on one node while a pass places replicas on it."""

    node: NodeView
    memory_gb: int
    gpus: int


def book_held(replicas: Iterable[ReplicaView], rooms: dict[str, Room]) -> dict[str, list[ReplicaView]]:
    """Replicas by model, with what each holds taken off its node's room."""
    by_model: dict[str, list[ReplicaView]] = defaultdict(list)
    for replica in replicas:
        by_model[replica.model].append(replica)
        room = rooms.get(replica.node or "")
        if room is not None and room.node.ready:
            room.memory_gb -= replica.held_gb
            room.gpus -= replica.gpus
        # A group's workers hold their share of it: that memory is used on their nodes.
        for node, memory_gb, _ in replica.shares:
            share_room = rooms.get(node)
            if share_room is not None and share_room.node.ready:
                share_room.memory_gb -= memory_gb
    return by_model


def holds(replica: ReplicaView) -> dict[str, tuple[int, int]]:
    """What a replica holds per node: its node's memory and GPUs, and a group's every worker's share."""
    held = {replica.node: (replica.held_gb, replica.gpus)}
    for node, memory_gb, _ in replica.shares:
        was = held.get(node, (0, 0))
        held[node] = (was[0] + memory_gb, was[1])
    return held


def release(replica: ReplicaView, rooms: dict[str, Room]) -> None:
    """Give back what a failed group held: its engines are gone or going."""
    rooms[replica.node].memory_gb += replica.held_gb
    rooms[replica.node].gpus += replica.gpus
    for node, memory_gb, _ in replica.shares:
        if node in rooms and rooms[node].node.ready:
            rooms[node].memory_gb += memory_gb


def reachable(replica: ReplicaView, rooms: dict[str, Room]) -> bool:
    room = rooms.get(replica.node or "")
    return replica.node is not None and room is not None and room.node.ready


def stop(plan: Plan, replica: ReplicaView, rooms: dict[str, Room], reason: str = "") -> None:
    (plan.stop if reachable(replica, rooms) else plan.forget).append(replica.id)
    if reason:
        plan.stop_reasons[replica.id] = reason
