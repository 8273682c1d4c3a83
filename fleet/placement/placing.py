"""Placing what is missing: a replica whose node was lost, a group broken, and new ones up to the count."""

from __future__ import annotations

from collections import defaultdict

from ..snapshots import Assignment, ModelView, Plan, ReplicaView, Unplaced
from .books import Room, reachable, release, stop
from .fit import explain, fits, profile_order
from .groups import find_group, group_assignment, group_broken, group_candidates


def usable_by_engine(
    rooms: dict[str, Room], wanted: dict[str, ModelView], engines_known: bool
) -> dict[str, list[Room]]:
    """Nodes that can take anything at all, by engine; what the candidates are
    scanned from, so a pass over a large fleet only looks at nodes that matter."""
    usable: dict[str, list[Room]] = defaultdict(list)
    all_engines = {p.engine for m in wanted.values() for p in m.profiles}
    for room in rooms.values():
        if room.node.ready and not room.node.draining:
            # When no node reports any engine, the fleet's agents are older than the
            # engine probe and nothing is known: every node is a candidate. The serve
            # page warns on the same condition, and the two must not disagree.
            for engine in room.node.engines if engines_known else all_engines:
                usable[engine].append(room)
    return usable


def place_missing(
    plan: Plan,
    model: ModelView,
    live: list[ReplicaView],
    rooms: dict[str, Room],
    usable_by_engine: dict[str, list[Room]],
    engines_known: bool,
) -> int:
    """Place replicas on lost nodes again, and new ones up to the count; how many fit nowhere."""
    on_node: dict[str, int] = defaultdict(int)
    per_profile: dict[str, int] = defaultdict(int)
    to_place: list[int | None] = []
    for replica in live:
        if reachable(replica, rooms) and (broken := group_broken(replica, rooms)):
            # A group is one replica: a worker failed or lost fails it, and a new group is placed
            # (the old one's engine on its head is stopped; what it held is free again).
            release(replica, rooms)
            stop(plan, replica, rooms, broken)
            plan.stop_now.add(replica.id)
            to_place.append(None)
        elif reachable(replica, rooms):
            on_node[replica.node] += 1
            per_profile[replica.profile] += 1
        else:
            to_place.append(replica.id)
    to_place += [None] * (model.replicas - len(live))

    unplaced = 0
    for replica_id in to_place:
        if model.not_ready:
            unplaced += 1
            plan.unplaced.append(Unplaced(replica_id, model.name, model.not_ready, model.cause))
            continue
        assignment = _place_one(model, replica_id, usable_by_engine, on_node, per_profile)
        if assignment is None:
            unplaced += 1
            plan.unplaced.append(
                Unplaced(replica_id, model.name, explain(model, rooms.values(), engines_known), model.cause)
            )
            continue
        room = rooms[assignment.node]
        room.memory_gb -= assignment.memory_gb
        room.gpus -= assignment.profile.gpus
        for share in assignment.shares:
            rooms[share.node].memory_gb -= share.memory_gb
        on_node[assignment.node] += 1
        per_profile[assignment.profile.name] += 1
        plan.assign.append(assignment)
    return unplaced


def _place_one(
    model: ModelView,
    replica_id: int | None,
    usable_by_engine: dict[str, list[Room]],
    on_node: dict[str, int],
    per_profile: dict[str, int],
) -> Assignment | None:
    for profile in profile_order(model.profiles, per_profile):
        best = None
        best_key = None
        need_memory, need_gpus, selector = profile.need_gb, profile.gpus, profile.node_selector
        for room in usable_by_engine.get(profile.engine, ()):
            # `fits` unrolled for speed: a pass over a large fleet asks it a million times,
            # and a call each time cost a fifth of the pass. `fits` stays the rule.
            if room.memory_gb < need_memory or room.gpus < need_gpus or (selector and not fits(profile, room)):
                continue
            # Spread first, then weights already on disk, then the most room left.
            key = (on_node.get(room.node.name, 0), model.source not in room.node.holds, -room.memory_gb, room.node.name)
            if best_key is None or key < best_key:
                best, best_key = room, key
        if best is not None:
            return Assignment(replica_id, model.name, profile, best.node.name, model.source, model.cause)
        if profile.nodes > 1:
            candidates = group_candidates(profile, usable_by_engine.get(profile.engine, ()))
            if group := find_group(profile, candidates, model.source):
                head, workers = group
                return group_assignment(model, replica_id, profile, head, workers)
    return None
