"""One replica across several nodes (issue 37): which nodes form a group, how its layers are split, and when it breaks."""

from __future__ import annotations

from collections.abc import Iterable

from ..snapshots import FAILED, Assignment, ModelView, ProfileView, ReplicaView, Share
from .books import Room


def group_candidates(profile: ProfileView, rooms: Iterable[Room], engines_known: bool = True) -> list[Room]:
    """Nodes that could take a share of a group of this profile: ready, with its engine, labels and some room."""
    return [
        room
        for room in rooms
        if room.node.ready
        and not room.node.draining
        and (not engines_known or profile.engine in room.node.engines)
        and room.memory_gb > 0
        and room.gpus >= profile.gpus
        and all(room.node.labels.get(k) == v for k, v in profile.node_selector.items())
    ]


def _can_lead(profile: ProfileView, room: Room) -> bool:
    # llama.cpp's head runs llama-server with --rpc: its build must have the backend. vLLM's is Ray's head.
    return room.node.rpc_head or profile.engine != "llamacpp"


def _can_work(profile: ProfileView, room: Room) -> bool:
    # llama.cpp's worker runs rpc-server behind stunnel (Facts `rpc`). vLLM's is a Ray worker.
    return room.node.rpc or profile.engine != "llamacpp"


def find_group(profile: ProfileView, candidates: list[Room], source: str) -> tuple[Room, list[Room]] | None:
    """The fewest nodes, up to the profile's `nodes`, whose free memory together holds it: (head, workers).

    The most free memory first, so a group is as few nodes as it can be (each one more is
    traffic on every token); the head is the largest that can lead, the weights on its disk first.
    """
    by_room = sorted(candidates, key=lambda r: (-r.memory_gb, r.node.name))
    heads = [r for r in by_room if _can_lead(profile, r)]
    if not heads:
        return None
    head = min(heads, key=lambda r: (-r.memory_gb, source not in r.node.holds, r.node.name))
    chosen, total = [head], head.memory_gb
    for room in by_room:
        if total >= profile.need_gb or len(chosen) >= profile.nodes:
            break
        if room is not head and _can_work(profile, room):
            chosen.append(room)
            total += room.memory_gb
    if total < profile.need_gb:
        return None
    return head, chosen[1:]


def group_assignment(
    model: ModelView, replica_id: int | None, profile: ProfileView, head: Room, workers: list[Room]
) -> Assignment:
    """Layers split by each node's free memory (llama.cpp's --tensor-split), each node booked its part."""
    total = head.memory_gb + sum(w.memory_gb for w in workers)

    def part(room: Room) -> tuple[float, int]:
        fraction = room.memory_gb / total
        return round(fraction, 4), min(room.memory_gb, -(-profile.need_gb * room.memory_gb // total))

    head_share, head_gb = part(head)
    shares = tuple(Share(w.node.name, *part(w)) for w in workers)
    said = [f"{head.node.name} leads with {head_share:.0%} of the layers, {head_gb} GB of {head.memory_gb} free"]
    said += [
        f"{w.node.name} holds {s.share:.0%}, {s.memory_gb} GB of {w.memory_gb} free"
        for w, s in zip(workers, shares, strict=True)
    ]
    explanation = f"across {len(workers) + 1} nodes, no one of which holds {profile.need_gb} GB: " + "; ".join(said)
    return Assignment(
        replica_id,
        model.name,
        profile,
        head.node.name,
        model.source,
        model.cause,
        shares=shares,
        head_share=head_share,
        head_gb=head_gb,
        explanation=explanation,
    )


def group_short(profile: ProfileView, rooms: Iterable[Room], engines_known: bool = True) -> str:
    """Why no group of this profile fits, in a sentence (the end of `explain`'s)."""
    candidates = sorted(group_candidates(profile, rooms, engines_known), key=lambda r: -r.memory_gb)
    if not candidates:
        return f"across up to {profile.nodes} nodes: no node has room for a share"
    if not any(_can_lead(profile, r) for r in candidates):
        return f"across up to {profile.nodes} nodes: none of the nodes with room can lead a group (no RPC backend)"
    head = next(r for r in candidates if _can_lead(profile, r))
    largest = [head] + [r for r in candidates if r is not head and _can_work(profile, r)][: profile.nodes - 1]
    held = sum(r.memory_gb for r in largest)
    return (
        f"across up to {profile.nodes} nodes: the {len(largest)} with the most free memory hold {held} GB together, "
        f"needs {profile.need_gb}"
    )


def group_broken(replica: ReplicaView, rooms: dict[str, Room]) -> str | None:
    """Why a group cannot serve any more, naming the worker; None for one node, or a whole group."""
    for node, _, _ in replica.shares:
        room = rooms.get(node)
        if room is None or not room.node.ready:
            return f"worker {node} was lost: the group is placed again"
    if not replica.retry_due:
        # A failure waits its retry delay, as a replica on one node does: no new group every pass.
        return None
    for node, _, state in replica.shares:
        if state == FAILED:
            return f"worker {node} failed: the group is placed again"
    if replica.shares and replica.state == FAILED:
        return "its head failed: the group is placed again"
    return None
