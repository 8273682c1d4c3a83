"""Which replicas a pass stops: of models deleted, over the count, outdated, or on a node draining.

An outdated replica, and one on a draining node, is replaced as a rolling replacement: it
keeps serving until a current one can take its place (`retire`).
"""

from __future__ import annotations

from ..snapshots import FAILED, READY, STOPPING, ModelView, Plan, ReplicaView
from .books import Room, holds, reachable, stop
from .making_room import frees_room_for


def stop_unwanted(
    plan: Plan, by_model: dict[str, list[ReplicaView]], wanted: dict[str, ModelView], rooms: dict[str, Room]
) -> None:
    for model_name, held in by_model.items():
        for replica in held:
            if replica.state == STOPPING:
                # Already told to stop; only a lost node leaves nobody to say it has.
                if not reachable(replica, rooms):
                    plan.forget.append(replica.id)
            elif model_name not in wanted:
                # Deleted from the catalog: everything it runs stops.
                stop(plan, replica, rooms)


def current_and_outdated(model: ModelView, held: list[ReplicaView]) -> tuple[list[ReplicaView], list[ReplicaView]]:
    """A model's replicas that run what the catalog says, and those that run something older."""
    profiles = {p.name: p for p in model.profiles}
    live: list[ReplicaView] = []
    outdated: list[ReplicaView] = []
    for replica in held:
        if replica.state == STOPPING:
            continue
        if replica.node is None and not replica.profile:
            # Never placed (pending, with the reason it fits nowhere): nothing runs to be outdated.
            live.append(replica)
            continue
        if replica.profile not in profiles or not replica.runs_as(model, profiles[replica.profile]):
            # Its profile was removed, or the catalog entry was edited (a new
            # --ctx-size, another version): an engine keeps what it was started
            # with, so it is replaced, and stopped once its replacement serves.
            outdated.append(replica)
            continue
        live.append(replica)
    return live, outdated


def leaving_draining(
    live: list[ReplicaView], outdated: list[ReplicaView], rooms: dict[str, Room]
) -> tuple[list[ReplicaView], list[ReplicaView]]:
    """A replica on a draining node (a group's head or any of its workers) is replaced elsewhere as an outdated one is.

    A rolling replacement (`retire`): a new one is placed on nodes not draining, and the old
    one, drained of its requests (fleet/drain.py), is stopped (a group whole) once the new one
    serves; while no new one fits, the old one keeps serving. So a drained node empties, as
    docs/fleet.md's "Removing a node" waits for.
    """
    leaving = [r for r in live if reachable(r, rooms) and any(rooms[n].node.draining for n in holds(r) if n in rooms)]
    return [r for r in live if r not in leaving], outdated + leaving


def trim_extras(plan: Plan, model: ModelView, live: list[ReplicaView], rooms: dict[str, Room]) -> list[ReplicaView]:
    """Stop what is over the count; what is left."""

    # Extras go first where they cost least: not yet placed, then on lost
    # nodes, then failed, then idle, then the newest. One with requests in flight
    # is never stopped: it stays until a later pass finds it idle.
    def expendable(r: ReplicaView) -> tuple:
        return (r.node is not None, reachable(r, rooms), r.state != FAILED, r.id in model.busy, -r.id)

    live = sorted(live, key=expendable)
    extra = max(0, len(live) - model.replicas)
    kept = []
    for replica in live[:extra]:
        if replica.id in model.busy and reachable(replica, rooms):
            kept.append(replica)
            continue
        stop(plan, replica, rooms, model.stop_reason)
    return kept + live[extra:]


def retire(
    plan: Plan,
    model: ModelView,
    live: list[ReplicaView],
    outdated: list[ReplicaView],
    unplaced: int,
    rooms: dict[str, Room],
    engines_known: bool,
) -> None:
    """Stop outdated replicas without leaving the model with fewer serving than it asks for.

    A rolling replacement: an outdated replica that still serves is stopped only
    once a current one is ready to take its place. When its replacement fits
    nowhere because the old engine holds the room it needs, it is stopped anyway,
    since waiting would wait forever: on a full fleet an edit costs a short gap.
    When the replacement fits nowhere for another reason (no node has the new
    engine), the old one keeps serving.
    """
    serving = sum(1 for r in live if r.state == READY and reachable(r, rooms))
    still_serving = [r for r in outdated if r.state == READY and reachable(r, rooms)]
    for replica in outdated:
        if replica not in still_serving:
            stop(plan, replica, rooms)
    serving += len(still_serving)
    for replica in sorted(still_serving, key=lambda r: -r.id):
        if serving - 1 >= model.replicas:
            stop(plan, replica, rooms)
            serving -= 1
        elif unplaced > 0 and frees_room_for(model, replica, rooms, engines_known):
            stop(plan, replica, rooms)
            serving -= 1
            unplaced -= 1
