"""How many replicas each model wants now: its fewest and most, and the load in between.

The gateway writes its load into Redis (contracts/demand.py); each reconcile pass
reads the whole hash once (one HGETALL, however many models), sums the fresh
snapshots, and `decide`s per model from that and the model's `Scale` row. Only
rows whose values changed are written. Placement then keeps each model at the count
decided here, stopping only replicas with no request in flight.

The rules (docs/placement.md#on-demand):
- up at once, to what the load needs (in flight and waiting over the target load per
  replica), never past most; a request waiting for a model at zero wakes it;
- down one replica at a time, each after a quiet period in which the load never
  needed them all, never below fewest, never a replica with requests in flight;
- with fewest 0, the last replica stops after the idle time without a request.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from datetime import UTC, datetime

from django.db import transaction
from django.utils import timezone

from common import audit
from contracts import demand

from . import engine_stats
from .live import redis_client
from .models import Replica, Scale
from .snapshots import READY, ModelView, Plan, Scaling

WOKEN = "woken by a request"
# How the count's `why` starts when it went down.
LOWERED = ("quiet ", "idle ", "most lowered")
# {model: "busy_at last_request"}: the times that move with every request, kept out of the database.
TIMES_KEY = "llmgw:autoscale:times"
# Fields of the load hash this old are removed: a gateway process that is gone for good.
FORGET_AFTER_S = 600


@dataclass(frozen=True)
class State:
    """A model's Scale row as the decision reads and writes it."""

    replicas: int
    changed: float
    why: str = ""
    last_request: float = 0.0
    busy_at: float = 0.0


def duration(seconds: float) -> str:
    """`15 min`, `90 s`, `2 h`: how a quiet period or an idle time is said on a replica."""
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{seconds // 3600:.0f} h"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{seconds // 60:.0f} min"
    return f"{seconds:.0f} s"


def decide(
    scaling: Scaling,
    state: State,
    load: demand.ModelLoad | None,
    idle_replicas: int,
    now: float,
    engines: tuple[int, int, int] | None = None,
) -> tuple[State, str]:
    """The model's new state, and what a replica stopped for a lower count says ("" when none).

    `engines` is what the model's engines themselves say (fleet.engine_stats): (slots,
    slots busy, requests deferred), None where none said. The load is then the larger of
    the gateway's requests in flight and the engines' busy slots plus deferred requests
    (a request from a gateway that has not written its count yet is still in a slot), and a
    request deferred by an engine, all its slots taken, asks for one more replica whatever
    the target load says.
    """
    in_flight = int(load["in_flight"]) if load else 0
    waiting = int(load["waiting"]) if load else 0
    deferred = 0
    if engines is not None:
        _, busy, deferred = engines
        in_flight = max(in_flight, busy + deferred)
    last_request = max(state.last_request, float(load["last_request"]) if load else 0.0)
    count = min(max(state.replicas, scaling.fewest), scaling.most)
    why, changed = state.why, state.changed
    stop_reason = ""
    if count != state.replicas:
        why, changed = ("fewest" if count > state.replicas else f"most lowered to {count}"), now
        stop_reason = "" if count > state.replicas else why
    need = math.ceil((in_flight + waiting) / max(scaling.target_load, 1))
    if waiting:
        need = max(need, 1)
    if deferred:
        need = max(need, count + 1)
    busy_at = state.busy_at
    if need >= count and need > 0:
        busy_at = now
    if need > count and count < scaling.most:
        why = WOKEN if count == 0 else f"load: {in_flight} in flight, {waiting} waiting"
        if deferred:
            why += f", {deferred} deferred by the engines"
        count, changed = min(need, scaling.most), now
    elif count == 1 and scaling.fewest == 0 and in_flight == 0 and waiting == 0:
        # Idle from the last request, or from the last change (a wake, fewest lowered to 0).
        if now - max(last_request, changed) >= scaling.idle_s:
            stop_reason = why = f"idle {duration(scaling.idle_s)}"
            count, changed = 0, now
    if stop_reason == "" and count > max(need, scaling.fewest, 1) and idle_replicas > 0:
        if now - busy_at >= scaling.quiet_s and now - changed >= scaling.quiet_s:
            stop_reason = why = f"quiet {duration(scaling.quiet_s)}"
            count, changed = count - 1, now
    return State(count, changed, why, last_request, busy_at), stop_reason


def cause_of(state: State, scaling: Scaling) -> str:
    """What a replica added now is added for, in a word or three."""
    if state.replicas <= scaling.fewest:
        return "fewest"
    if state.why == WOKEN:
        return WOKEN
    return "load"


def read_load(now: float | None = None) -> tuple[dict[str, demand.ModelLoad], dict[int, int]]:
    """The fleet's load from every gateway process's snapshot; fields long dead are removed."""
    now = time.time() if now is None else now
    client = redis_client()
    snapshots, dead = [], []
    for field, raw in client.hgetall(demand.LOAD_KEY).items():
        snapshot = demand.decode(raw)
        if snapshot is None or now - snapshot["at"] > FORGET_AFTER_S:
            dead.append(field)
        else:
            snapshots.append(snapshot)
    if dead:
        client.hdel(demand.LOAD_KEY, *dead)
    return demand.total(snapshots, now)


def apply(models: list[ModelView], replicas: list[Replica], now: datetime) -> list[ModelView]:
    """The models with this pass's counts; Scale rows written only where the count changed.

    A model without `scaling` (a snapshot a test built) is left as it is. The two times
    that move with every request (the last request, the last time the load needed every
    replica) are kept in Redis, one hash written in one command a pass: written to the
    database each pass, 500 busy models cost half a second of a 5 s beat. The rows keep
    them as of the last change, which is what a pass falls back on when Redis lost them.
    """
    scaled = [m for m in models if m.scaling is not None]
    if not scaled:
        return models
    at = now.timestamp()
    loads, per_replica = read_load()
    stats = engine_stats.read(at)
    per_model = engine_stats.model_totals(stats, [r for r in replicas if r.state == READY and r.node_id is not None])
    client = redis_client()
    times = _read_times(client)
    rows = {s.model_name: s for s in Scale.objects.all()}
    ready, idle, busy = _ready_idle_busy(replicas, per_replica, stats)
    out, changed, created, new_times, recounted = [], [], [], {}, []
    for model in models:
        if model.scaling is None:
            out.append(model)
            continue
        row = rows.get(model.name)
        if row is None:
            row = Scale(model_name=model.name, replicas=model.scaling.fewest, changed=now, why="fewest")
            created.append(row)
        before = _state_before(row, times.get(model.name))
        after, stop_reason = decide(
            model.scaling, before, loads.get(model.name), idle.get(model.name, 0), at, per_model.get(model.name)
        )
        if (after.replicas, after.changed, after.why) != (before.replicas, before.changed, before.why):
            _write(row, after)
            if row.pk is not None:
                changed.append(row)
                if after.replicas != before.replicas:
                    recounted.append(
                        (row, {"replicas": [before.replicas, after.replicas], "why": [before.why, row.why]})
                    )
        if (after.busy_at, after.last_request) != times.get(model.name):
            new_times[model.name] = f"{after.busy_at} {after.last_request}"
        waiting = loads.get(model.name, {}).get("waiting", 0)
        out.append(_with_count(model, after, stop_reason, busy, ready.get(model.name, 0), waiting))
    _save(created, changed, recounted)
    if new_times:
        client.hset(TIMES_KEY, mapping=new_times)
    if gone := set(times) - {m.name for m in scaled}:
        client.hdel(TIMES_KEY, *gone)
    return out


def _with_count(
    model: ModelView, after: State, stop_reason: str, busy: frozenset[int], ready: int, waiting: int
) -> ModelView:
    """The model's snapshot with this pass's count, and what placement is to do about it."""
    return replace(
        model,
        replicas=after.replicas,
        busy=busy,
        cause=cause_of(after, model.scaling),
        # A replica kept past its pass (it had a request in flight) still says why when it goes.
        stop_reason=stop_reason or (after.why if after.why.startswith(LOWERED) else ""),
        make_room=bool(after.replicas) and not ready and (waiting > 0 or after.why == WOKEN),
        last_request=after.last_request,
    )


def _ready_idle_busy(
    replicas: list[Replica], per_replica: dict[int, int], stats: dict[int, dict]
) -> tuple[dict[str, int], dict[str, int], frozenset[int]]:
    """Ready and idle replicas counted per model, and the ids of the replicas busy by either count."""
    idle: dict[str, int] = {}
    ready: dict[str, int] = {}
    for r in replicas:
        if r.state == READY and r.node_id is not None:
            ready[r.model_name] = ready.get(r.model_name, 0) + 1
            # Idle by the gateway's count and by the engine's own, when it says.
            if not per_replica.get(r.pk) and not (stats.get(r.pk) or {}).get("slots_busy"):
                idle[r.model_name] = idle.get(r.model_name, 0) + 1
    busy = frozenset(replica_id for replica_id, count in per_replica.items() if count > 0) | frozenset(
        replica_id for replica_id, found in stats.items() if found["slots_busy"] > 0
    )
    return ready, idle, busy


def _state_before(row: Scale, times: tuple[float, float] | None) -> State:
    """A model's state as the last pass left it: its Scale row, with Redis's times where they are later."""
    # Without Redis's times (a Redis emptied), the quiet period counts from the last change.
    busy_at, last_request = times or (row.busy_at or row.changed.timestamp(), 0.0)
    return State(
        row.replicas,
        row.changed.timestamp(),
        row.why,
        max(row.last_request, last_request),
        max(row.busy_at, busy_at),
    )


def _save(created: list[Scale], changed: list[Scale], recounted: list[tuple[Scale, dict]]) -> None:
    """Write the pass's new and changed Scale rows, and a recount to the audit log."""
    if created:
        Scale.objects.bulk_create(created, ignore_conflicts=True)
    if changed:
        Scale.objects.bulk_update(changed, ["replicas", "changed", "why", "last_request", "busy_at"])
    for row, changes in recounted:
        audit.record_update(row, changes)  # by "system": bulk_update tells the audit log nothing


def _read_times(client) -> dict[str, tuple[float, float]]:
    """{model: (busy_at, last_request)} as the last pass left them."""
    times = {}
    for name, raw in client.hgetall(TIMES_KEY).items():
        try:
            busy_at, last_request = (float(v) for v in raw.split())
        except ValueError:
            continue
        times[name.decode() if isinstance(name, bytes) else name] = (busy_at, last_request)
    return times


def _write(row: Scale, state: State) -> None:
    row.replicas = state.replicas
    row.changed = datetime.fromtimestamp(state.changed, tz=UTC)
    row.why = state.why[:300]
    row.last_request = state.last_request
    row.busy_at = state.busy_at


def made_room(plan: Plan) -> None:
    """Lower the counts of models whose replicas were stopped to make room, so the next pass keeps them stopped."""
    for name, stopped in plan.made_room.items():
        row = Scale.objects.filter(model_name=name).first()
        if row is not None:
            row.replicas = max(0, row.replicas - stopped)
            row.why = "made room for another model"
            row.changed = timezone.now()
            row.save(update_fields=["replicas", "why", "changed"])


def wake(model: str, most: int, fewest: int) -> bool:
    """A request waits for this model: at least one replica, at once. False when most is 0."""
    if most < 1:
        return False
    now = time.time()
    Scale.objects.get_or_create(model_name=model, defaults={"replicas": fewest, "why": "fewest"})
    # The row read under its lock and written in the same transaction: read bare, a pass's count written
    # meanwhile (another control worker's autoscaling) was overwritten with the older one read here.
    with transaction.atomic():
        row = Scale.objects.select_for_update().get(model_name=model)
        row.last_request = max(row.last_request, now)
        fields = ["last_request"]
        if row.replicas < 1:
            row.replicas, row.why = 1, WOKEN
            row.changed = timezone.now()
            fields += ["replicas", "why", "changed"]
        row.save(update_fields=fields)
    return True
