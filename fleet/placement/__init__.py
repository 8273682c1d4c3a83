"""Where replicas run: one pure function over snapshots of the fleet and the catalog.

`place` reads plain dataclasses and touches no database, so the reconcile task,
the benchmark and the tests all run the same rules, and a test can build a fleet
of a thousand nodes in a line. `fleet.reconcile` builds the snapshots and applies
the plan.

The package by topic: `place` here (a pass over every model), `books` (what each node
has left while a pass places, and how a replica is stopped), `stopping` (what a pass stops:
deleted, over the count, outdated, leaving a draining node), `placing` (what is missing,
placed on a node or as a group), `groups` (one replica across several nodes), `making_room` (idle
replicas of other models stopped for one that fits nowhere), and `fit` (whether a node can
take a profile, and the sentence an unplaced replica shows: per node, why not).
"""

from __future__ import annotations

from collections.abc import Iterable

from ..snapshots import (  # noqa: F401  (the snapshots are placement's words: imported from here too)
    FAILED,
    FETCHING,
    HOLDING_WEIGHTS,
    MAKING_ROOM,
    PENDING,
    READY,
    STARTING,
    STOPPING,
    Assignment,
    ModelView,
    NodeView,
    Plan,
    ProfileView,
    ReplicaView,
    Scaling,
    Share,
    Unplaced,
)
from . import making_room, placing, stopping
from .books import Room, book_held


def place(nodes: Iterable[NodeView], models: Iterable[ModelView], replicas: Iterable[ReplicaView]) -> Plan:
    """Keep every model at its replica count: stop extras, place what is missing.

    A replica on a node that is no longer ready is placed again elsewhere; its row
    is kept (it is the same replica, moving), and an engine still running on the
    lost node is told to stop when that node reports it.
    """
    plan = Plan()
    rooms = {n.name: Room(n, n.memory_gb, n.gpus) for n in nodes}
    by_model = book_held(replicas, rooms)
    wanted = {m.name: m for m in models}
    stopping.stop_unwanted(plan, by_model, wanted, rooms)
    # A node whose only engine failed its self-test reports no engine, and is not old.
    engines_known = any(room.node.engines or room.node.engines_unusable for room in rooms.values())
    usable_by_engine = placing.usable_by_engine(rooms, wanted, engines_known)
    for model in sorted(wanted.values(), key=lambda m: m.name):
        live, outdated = stopping.leaving_draining(
            *stopping.current_and_outdated(model, by_model.get(model.name, [])), rooms
        )
        live = stopping.trim_extras(plan, model, live, rooms)
        unplaced = placing.place_missing(plan, model, live, rooms, usable_by_engine, engines_known)
        if unplaced and model.make_room:
            making_room.make_room(plan, model, wanted, by_model, rooms, engines_known)
        stopping.retire(plan, model, live, outdated, unplaced, rooms, engines_known)
    return plan
