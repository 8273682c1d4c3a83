"""Where replicas run: one pure function over snapshots of the fleet and the catalog.

`place` reads plain dataclasses and touches no database, so the reconcile task,
the benchmark and the tests all run the same rules, and a test can build a fleet
of a thousand nodes in a line. `fleet.reconcile` builds the snapshots and applies
the plan.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from . import room as making_room
from .snapshots import (  # noqa: F401  (the snapshots are placement's words: imported from here too)
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

# How a node's reasons are shown when nothing fits. Past a few nodes per reason
# and a few reasons, a list of a thousand node names tells staff nothing.
NAMES_PER_REASON = 3
REASONS_SHOWN = 8


@dataclass
class _Room:
    """What is left on one node while a pass places replicas on it."""

    node: NodeView
    memory_gb: int
    gpus: int


def place(nodes: Iterable[NodeView], models: Iterable[ModelView], replicas: Iterable[ReplicaView]) -> Plan:
    """Keep every model at its replica count: stop extras, place what is missing.

    A replica on a node that is no longer ready is placed again elsewhere; its row
    is kept (it is the same replica, moving), and an engine still running on the
    lost node is told to stop when that node reports it.
    """
    plan = Plan()
    rooms = {n.name: _Room(n, n.memory_gb, n.gpus) for n in nodes}
    by_model = _book_held(replicas, rooms)
    wanted = {m.name: m for m in models}
    _stop_unwanted(plan, by_model, wanted, rooms)
    # A node whose only engine failed its self-test reports no engine, and is not old.
    engines_known = any(room.node.engines or room.node.engines_unusable for room in rooms.values())
    usable_by_engine = _usable_by_engine(rooms, wanted, engines_known)
    for model in sorted(wanted.values(), key=lambda m: m.name):
        live, outdated = _leaving_draining(*_current_and_outdated(model, by_model.get(model.name, [])), rooms)
        live = _trim_extras(plan, model, live, rooms)
        unplaced = _place_missing(plan, model, live, rooms, usable_by_engine, engines_known)
        if unplaced and model.make_room:
            _make_room(plan, model, wanted, by_model, rooms, engines_known)
        _retire(plan, model, live, outdated, unplaced, rooms, engines_known)
    return plan


def _book_held(replicas: Iterable[ReplicaView], rooms: dict[str, _Room]) -> dict[str, list[ReplicaView]]:
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


def _stop_unwanted(
    plan: Plan, by_model: dict[str, list[ReplicaView]], wanted: dict[str, ModelView], rooms: dict[str, _Room]
) -> None:
    for model_name, held in by_model.items():
        for replica in held:
            if replica.state == STOPPING:
                # Already told to stop; only a lost node leaves nobody to say it has.
                if not _reachable(replica, rooms):
                    plan.forget.append(replica.id)
            elif model_name not in wanted:
                # Deleted from the catalog: everything it runs stops.
                _stop(plan, replica, rooms)


def _usable_by_engine(
    rooms: dict[str, _Room], wanted: dict[str, ModelView], engines_known: bool
) -> dict[str, list[_Room]]:
    """Nodes that can take anything at all, by engine; what the candidates are
    scanned from, so a pass over a large fleet only looks at nodes that matter."""
    usable: dict[str, list[_Room]] = defaultdict(list)
    all_engines = {p.engine for m in wanted.values() for p in m.profiles}
    for room in rooms.values():
        if room.node.ready and not room.node.draining:
            # When no node reports any engine, the fleet's agents are older than the
            # engine probe and nothing is known: every node is a candidate. The serve
            # page warns on the same condition, and the two must not disagree.
            for engine in room.node.engines if engines_known else all_engines:
                usable[engine].append(room)
    return usable


def _current_and_outdated(model: ModelView, held: list[ReplicaView]) -> tuple[list[ReplicaView], list[ReplicaView]]:
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


def _leaving_draining(
    live: list[ReplicaView], outdated: list[ReplicaView], rooms: dict[str, _Room]
) -> tuple[list[ReplicaView], list[ReplicaView]]:
    """A replica on a draining node (a group's head or any of its workers) is replaced elsewhere as an outdated one is.

    A rolling replacement (`_retire`): a new one is placed on nodes not draining, and the old
    one, drained of its requests (fleet/drain.py), is stopped (a group whole) once the new one
    serves; while no new one fits, the old one keeps serving. So a drained node empties, as
    docs/fleet.md's "Removing a node" waits for.
    """
    leaving = [r for r in live if _reachable(r, rooms) and any(rooms[n].node.draining for n in _holds(r) if n in rooms)]
    return [r for r in live if r not in leaving], outdated + leaving


def _trim_extras(plan: Plan, model: ModelView, live: list[ReplicaView], rooms: dict[str, _Room]) -> list[ReplicaView]:
    """Stop what is over the count; what is left."""

    # Extras go first where they cost least: not yet placed, then on lost
    # nodes, then failed, then idle, then the newest. One with requests in flight
    # is never stopped: it stays until a later pass finds it idle.
    def expendable(r: ReplicaView) -> tuple:
        return (r.node is not None, _reachable(r, rooms), r.state != FAILED, r.id in model.busy, -r.id)

    live = sorted(live, key=expendable)
    extra = max(0, len(live) - model.replicas)
    kept = []
    for replica in live[:extra]:
        if replica.id in model.busy and _reachable(replica, rooms):
            kept.append(replica)
            continue
        _stop(plan, replica, rooms, model.stop_reason)
    return kept + live[extra:]


def _place_missing(
    plan: Plan,
    model: ModelView,
    live: list[ReplicaView],
    rooms: dict[str, _Room],
    usable_by_engine: dict[str, list[_Room]],
    engines_known: bool,
) -> int:
    """Place replicas on lost nodes again, and new ones up to the count; how many fit nowhere."""
    on_node: dict[str, int] = defaultdict(int)
    per_profile: dict[str, int] = defaultdict(int)
    to_place: list[int | None] = []
    for replica in live:
        if _reachable(replica, rooms) and (broken := _group_broken(replica, rooms)):
            # A group is one replica: a worker failed or lost fails it, and a new group is placed
            # (the old one's engine on its head is stopped; what it held is free again).
            _release(replica, rooms)
            _stop(plan, replica, rooms, broken)
            plan.stop_now.add(replica.id)
            to_place.append(None)
        elif _reachable(replica, rooms):
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


def _retire(
    plan: Plan,
    model: ModelView,
    live: list[ReplicaView],
    outdated: list[ReplicaView],
    unplaced: int,
    rooms: dict[str, _Room],
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
    serving = sum(1 for r in live if r.state == READY and _reachable(r, rooms))
    still_serving = [r for r in outdated if r.state == READY and _reachable(r, rooms)]
    for replica in outdated:
        if replica not in still_serving:
            _stop(plan, replica, rooms)
    serving += len(still_serving)
    for replica in sorted(still_serving, key=lambda r: -r.id):
        if serving - 1 >= model.replicas:
            _stop(plan, replica, rooms)
            serving -= 1
        elif unplaced > 0 and _frees_room_for(model, replica, rooms, engines_known):
            _stop(plan, replica, rooms)
            serving -= 1
            unplaced -= 1


def _make_room(
    plan: Plan,
    model: ModelView,
    wanted: dict[str, ModelView],
    by_model: dict[str, list[ReplicaView]],
    rooms: dict[str, _Room],
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
        freed = _Room(rooms[node].node, memory, gpus)
        return any(why_not(profile, freed, engines_known) is None for profile in model.profiles)

    def group_fits(now: dict[str, tuple[int, int]]) -> bool:
        freed = [_Room(rooms[n].node, memory, gpus) for n, (memory, gpus) in now.items()]
        return any(
            _group(profile, _group_candidates(profile, freed, engines_known), model.source)
            for profile in model.profiles
            if profile.nodes > 1
        )

    choice = making_room.choose(candidates, spare, free, stopping, fits_with)
    if choice is None and any(profile.nodes > 1 for profile in model.profiles):
        choice = making_room.choose_group(candidates, spare, free, stopping, group_fits)
    if choice is None:
        return
    for victim in choice.stop:
        replica = next(r for r in by_model[victim.model] if r.id == victim.replica)
        _stop(plan, replica, rooms, f"{MAKING_ROOM}{model.name}: frees {_freed(victim)}")
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
    rooms: dict[str, _Room],
) -> tuple[list[making_room.Candidate], dict[str, int], dict[str, tuple[int, int]]]:
    """The idle replicas making room may stop, how many each model may lose, and what stopping ones give back per node.

    A group (issue 37) is one candidate that frees its head's memory and every worker's share.
    """
    priority = model.scaling.priority if model.scaling else 100
    told = set(plan.stop)
    stopping: dict[str, tuple[int, int]] = {}
    candidates, spare = [], {}
    for name, held in by_model.items():
        other = wanted.get(name)
        reachable = [r for r in held if _reachable(r, rooms)]
        for r in reachable:
            if r.state == STOPPING or r.id in told:
                for node, (memory, gpus) in _holds(r).items():
                    was = stopping.get(node, (0, 0))
                    stopping[node] = (was[0] + memory, was[1] + gpus)
        if other is None or other.scaling is None or name == model.name or other.scaling.priority > priority:
            continue
        live = [r for r in reachable if r.state != STOPPING and r.id not in told]
        spare[name] = len(live) - other.scaling.fewest
        candidates += [
            making_room.Candidate(
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


def _holds(replica: ReplicaView) -> dict[str, tuple[int, int]]:
    """What a replica holds per node: its node's memory and GPUs, and a group's every worker's share."""
    held = {replica.node: (replica.held_gb, replica.gpus)}
    for node, memory_gb, _ in replica.shares:
        was = held.get(node, (0, 0))
        held[node] = (was[0] + memory_gb, was[1])
    return held


def _freed(victim: making_room.Candidate) -> str:
    """What a replica stopped to make room frees, in the words its reason shows."""
    measured = " (measured)" if victim.measured else ""
    if not victim.shares:
        return f"{victim.memory_gb} GB on {victim.node}{measured}"
    parts = [f"{memory} GB on {node}" for node, (memory, _) in victim.frees().items()]
    return f"{', '.join(parts)}{measured}: a group across {len(parts)} nodes, stopped whole"


def _frees_room_for(model: ModelView, replica: ReplicaView, rooms: dict[str, _Room], engines_known: bool) -> bool:
    """Whether a current profile would fit once the replica is gone: on one of its nodes, or as a group.

    A group (issue 37) gives back its head's memory and every worker's share at once.
    """
    freed = {name: _Room(room.node, room.memory_gb, room.gpus) for name, room in rooms.items()}
    _release(replica, freed)
    for node in _holds(replica):
        if node in freed and any(why_not(profile, freed[node], engines_known) is None for profile in model.profiles):
            return True
    return any(
        _group(profile, _group_candidates(profile, freed.values(), engines_known), model.source)
        for profile in model.profiles
        if profile.nodes > 1
    )


def _group_broken(replica: ReplicaView, rooms: dict[str, _Room]) -> str | None:
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


def _release(replica: ReplicaView, rooms: dict[str, _Room]) -> None:
    """Give back what a failed group held: its engines are gone or going."""
    rooms[replica.node].memory_gb += replica.held_gb
    rooms[replica.node].gpus += replica.gpus
    for node, memory_gb, _ in replica.shares:
        if node in rooms and rooms[node].node.ready:
            rooms[node].memory_gb += memory_gb


def _reachable(replica: ReplicaView, rooms: dict[str, _Room]) -> bool:
    room = rooms.get(replica.node or "")
    return replica.node is not None and room is not None and room.node.ready


def _stop(plan: Plan, replica: ReplicaView, rooms: dict[str, _Room], reason: str = "") -> None:
    (plan.stop if _reachable(replica, rooms) else plan.forget).append(replica.id)
    if reason:
        plan.stop_reasons[replica.id] = reason


def profile_order(profiles: Sequence[ProfileView], per_profile: dict[str, int]) -> list[ProfileView]:
    """Higher priority first; among equals, the one furthest below its share by weight."""

    def key(p: ProfileView) -> tuple:
        share = per_profile.get(p.name, 0) / max(p.weight, 1)
        return (-p.priority, share, -p.weight, p.name)

    return sorted(profiles, key=key)


def _place_one(
    model: ModelView,
    replica_id: int | None,
    usable_by_engine: dict[str, list[_Room]],
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
            candidates = _group_candidates(profile, usable_by_engine.get(profile.engine, ()))
            if group := _group(profile, candidates, model.source):
                head, workers = group
                return _group_assignment(model, replica_id, profile, head, workers)
    return None


def _group_candidates(profile: ProfileView, rooms: Iterable[_Room], engines_known: bool = True) -> list[_Room]:
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


def _can_lead(profile: ProfileView, room: _Room) -> bool:
    # llama.cpp's head runs llama-server with --rpc: its build must have the backend. vLLM's is Ray's head.
    return room.node.rpc_head or profile.engine != "llamacpp"


def _can_work(profile: ProfileView, room: _Room) -> bool:
    # llama.cpp's worker runs rpc-server behind stunnel (Facts `rpc`). vLLM's is a Ray worker.
    return room.node.rpc or profile.engine != "llamacpp"


def _group(profile: ProfileView, candidates: list[_Room], source: str) -> tuple[_Room, list[_Room]] | None:
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


def _group_assignment(
    model: ModelView, replica_id: int | None, profile: ProfileView, head: _Room, workers: list[_Room]
) -> Assignment:
    """Layers split by each node's free memory (llama.cpp's --tensor-split), each node booked its part."""
    total = head.memory_gb + sum(w.memory_gb for w in workers)

    def part(room: _Room) -> tuple[float, int]:
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


def group_short(profile: ProfileView, rooms: Iterable[_Room], engines_known: bool = True) -> str:
    """Why no group of this profile fits, in a sentence (the end of `explain`'s)."""
    candidates = sorted(_group_candidates(profile, rooms, engines_known), key=lambda r: -r.memory_gb)
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


def why_not(profile: ProfileView, room: _Room, engines_known: bool = True) -> str | None:
    """Why this node cannot take a replica of this profile, or None when it can."""
    node = room.node
    if not node.ready:
        return "not ready"
    if node.draining:
        return "draining"
    if engines_known and profile.engine not in node.engines:
        if profile.engine in node.engines_unusable:
            return f"{profile.engine} is installed but unusable ({node.engines_unusable[profile.engine]})"
        return f"no {profile.engine}"
    return short_of(profile, room)


def fits(profile: ProfileView, room: _Room) -> bool:
    """The fit test, for a node that is ready and has the engine: labels, memory, GPUs.

    Placement asks it of every candidate, and `short_of` says why it said no, so the
    sentence a replica shows is the rule that kept it off the node. A bool first:
    placement asks it a million times on a large fleet and wants no sentences.
    """
    if room.memory_gb < profile.need_gb or room.gpus < profile.gpus:
        return False
    if not profile.node_selector:
        return True
    labels = room.node.labels
    return all(labels.get(key) == value for key, value in profile.node_selector.items())


def short_of(profile: ProfileView, room: _Room) -> str | None:
    """Why `fits` says no, in the words a replica shows; None when it fits."""
    if fits(profile, room):
        return None
    labels = room.node.labels
    for key, value in profile.node_selector.items():
        if key not in labels:
            return f"no label {key}"
        if labels[key] != value:
            return f"{key} is {labels[key]}, needs {value}"
    if room.memory_gb < profile.need_gb:
        if profile.measured_gb > profile.min_memory_gb:
            return (
                f"{max(room.memory_gb, 0)} GB free, needs {profile.need_gb} "
                f"(measured; the profile asks {profile.min_memory_gb})"
            )
        return f"{max(room.memory_gb, 0)} GB free, needs {profile.need_gb}"
    return f"{max(room.gpus, 0)} GPU{'s' if room.gpus != 1 else ''} free, needs {profile.gpus}"


def explain(model: ModelView, rooms: Iterable[_Room], engines_known: bool = True) -> str:
    """The sentence an unplaceable replica shows: per node, why it was not chosen."""
    rooms = sorted(rooms, key=lambda r: r.node.name)
    if not model.profiles:
        return f"{model.name} has no profile to run it with"
    if not rooms:
        return "no node has enrolled"
    parts = []
    for profile in profile_order(model.profiles, {}):
        by_reason: dict[str, list[str]] = {}
        for room in rooms:
            reason = why_not(profile, room, engines_known)
            if reason is not None:
                by_reason.setdefault(reason, []).append(room.node.name)
        text = _grouped(by_reason)
        if profile.nodes > 1:
            text += f"; {group_short(profile, rooms, engines_known)}"
        parts.append(f"profile {profile.name}: {text}" if len(model.profiles) > 1 else text)
    return ". ".join(parts)


def _grouped(by_reason: dict[str, list[str]]) -> str:
    shown = []
    for reason, names in list(by_reason.items())[:REASONS_SHOWN]:
        listed = ", ".join(names[:NAMES_PER_REASON])
        if len(names) > NAMES_PER_REASON:
            listed += f" and {len(names) - NAMES_PER_REASON} more"
        shown.append(f"{listed}: {reason}")
    hidden = sum(len(n) for n in list(by_reason.values())[REASONS_SHOWN:])
    if hidden:
        shown.append(f"{hidden} more nodes for other reasons")
    return "; ".join(shown)
