"""Making room for a model that fits nowhere: which idle replicas of other models a pass may stop, and where.

The choice itself is `fleet.room`'s, over plain values; this module gives it placement's
books (what each node has free, what stopping each replica gives back) and writes the
stops and the sentence the waiting replica shows into the plan.
"""

from __future__ import annotations

from dataclasses import replace

from .. import room as choosing
from ..snapshots import FAILED, MAKING_ROOM, READY, STOPPING, ModelView, Plan, ReplicaView
from .books import Room, holds, reachable, release, stop
from .fit import why_not
from .groups import find_group, group_candidates


def make_room(
    plan: Plan,
    model: ModelView,
    wanted: dict[str, ModelView],
    by_model: dict[str, list[ReplicaView]],
    rooms: dict[str, Room],
    engines_known: bool,
) -> None:
    """Stop idle replicas of other models so that this one fits (fleet.room has the rules).

    On one node when a profile fits one; else, for a profile that may span nodes, on the
    nodes a group would take, together. Its replica stays unplaced this pass, saying where
    it waits: the room is booked until the stopped engines are gone, and the next pass
    places it there.
    """
    candidates, spare, stopping = _room_candidates(plan, model, wanted, by_model, rooms)
    free = {n: (room.memory_gb, room.gpus) for n, room in rooms.items() if room.node.ready and not room.node.draining}

    def fits_with(node: str, memory: int, gpus: int) -> bool:
        freed = Room(rooms[node].node, memory, gpus)
        return any(why_not(profile, freed, engines_known) is None for profile in model.profiles)

    def group_fits(now: dict[str, tuple[int, int]]) -> bool:
        freed = [Room(rooms[n].node, memory, gpus) for n, (memory, gpus) in now.items()]
        return any(
            find_group(profile, group_candidates(profile, freed, engines_known), model.source)
            for profile in model.profiles
            if profile.nodes > 1
        )

    choice = choosing.choose(candidates, spare, free, stopping, fits_with)
    if choice is None and any(profile.nodes > 1 for profile in model.profiles):
        choice = choosing.choose_group(candidates, spare, free, stopping, group_fits)
    if choice is None:
        return
    for victim in choice.stop:
        replica = next(r for r in by_model[victim.model] if r.id == victim.replica)
        stop(plan, replica, rooms, f"{MAKING_ROOM}{model.name}: frees {_freed(victim)}")
        plan.made_room[victim.model] = plan.made_room.get(victim.model, 0) + 1
    names = sorted({v.model for v in choice.stop})
    where = ", ".join(choice.nodes or (choice.node,))
    waiting = (
        f"waiting for room on {where}: stopping idle replicas of {', '.join(names)}"
        if names
        else f"waiting for room on {where}: replicas there are stopping"
    )
    for i, u in enumerate(plan.unplaced):
        if u.model == model.name:
            plan.unplaced[i] = replace(u, reason=waiting)


def _room_candidates(
    plan: Plan,
    model: ModelView,
    wanted: dict[str, ModelView],
    by_model: dict[str, list[ReplicaView]],
    rooms: dict[str, Room],
) -> tuple[list[choosing.Candidate], dict[str, int], dict[str, tuple[int, int]]]:
    """The idle replicas making room may stop, how many each model may lose, and what stopping ones give back per node.

    A group (issue 37) is one candidate that frees its head's memory and every worker's share.
    """
    priority = model.scaling.priority if model.scaling else 100
    told = set(plan.stop)
    stopping: dict[str, tuple[int, int]] = {}
    candidates, spare = [], {}
    for name, held in by_model.items():
        other = wanted.get(name)
        reachable_now = [r for r in held if reachable(r, rooms)]
        for r in reachable_now:
            if r.state == STOPPING or r.id in told:
                for node, (memory, gpus) in holds(r).items():
                    was = stopping.get(node, (0, 0))
                    stopping[node] = (was[0] + memory, was[1] + gpus)
        if other is None or other.scaling is None or name == model.name or other.scaling.priority > priority:
            continue
        live = [r for r in reachable_now if r.state != STOPPING and r.id not in told]
        spare[name] = len(live) - other.scaling.fewest
        candidates += [
            choosing.Candidate(
                r.id,
                name,
                r.node,
                r.held_gb,
                r.gpus,
                other.scaling.priority,
                other.last_request,
                measured=r.measured_gb > r.memory_gb,
                shares=tuple((node, memory_gb) for node, memory_gb, _ in r.shares),
            )
            for r in live
            if r.state in (READY, FAILED) and r.id not in other.busy
        ]
    return candidates, spare, stopping


def _freed(victim: choosing.Candidate) -> str:
    """What a replica stopped to make room frees, in the words its reason shows."""
    measured = " (measured)" if victim.measured else ""
    if not victim.shares:
        return f"{victim.memory_gb} GB on {victim.node}{measured}"
    parts = [f"{memory} GB on {node}" for node, (memory, _) in victim.frees().items()]
    return f"{', '.join(parts)}{measured}: a group across {len(parts)} nodes, stopped whole"


def frees_room_for(model: ModelView, replica: ReplicaView, rooms: dict[str, Room], engines_known: bool) -> bool:
    """Whether a current profile would fit once the replica is gone: on one of its nodes, or as a group.

    A group (issue 37) gives back its head's memory and every worker's share at once.
    """
    freed = {name: Room(room.node, room.memory_gb, room.gpus) for name, room in rooms.items()}
    release(replica, freed)
    for node in holds(replica):
        if node in freed and any(why_not(profile, freed[node], engines_known) is None for profile in model.profiles):
            return True
    return any(
        find_group(profile, group_candidates(profile, freed.values(), engines_known), model.source)
        for profile in model.profiles
        if profile.nodes > 1
    )
