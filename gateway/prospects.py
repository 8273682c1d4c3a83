"""What a model with no ready replica can become: whether a request for it should wait, and why.

A model "can wake" when a replica is on its way (pending, fetching, starting, failed
and being started again, ready but not routed yet, on a node that was lost) or when it
has none and may have one (scaled to zero: fewest 0, most above 0). It "cannot" when
its most is 0, or when every replica it has failed FAILURES_WAITED times in a row:
holding a request for five minutes for a model that keeps failing helps nobody.

`judge` is a pure function over rows, so the rules are tested without a database;
`read` fetches the rows (in a thread: it reads the database and Redis).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis
from django.conf import settings

from catalog.models import Model
from contracts import progress
from fleet.live import redis_client
from fleet.models import Replica

READY, CAN_WAKE, CANNOT = "ready", "can wake", "cannot"
# A replica that failed this many times in a row is not waited for.
FAILURES_WAITED = 3
# The order in which a replica's state is the one a waiting client is told.
NEAREST = ("routed", "unrouted", "starting", "fetching", "pending", "retrying", "lost")


@dataclass(frozen=True)
class ReplicaRow:
    id: int
    state: str
    reason: str
    attempts: int
    node: str  # "" when not placed
    node_alive: bool
    percent: str | None  # "43%" for a fetching replica whose node reports progress


@dataclass(frozen=True)
class Prospect:
    state: str  # READY, CAN_WAKE or CANNOT
    status: str  # a few words for a waiting client: "fetching 43%", "scaled to zero, waking"
    reason: str  # a sentence without its full stop: what each replica is doing, or why none will come


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0].rstrip(".") if text.strip() else ""


def _said(replica: ReplicaRow, routed: bool) -> tuple[str, str, str]:
    """(kind, status, clause) of one replica: kind orders them, NEAREST first."""
    where = f" on {replica.node}" if replica.node else ""
    name = f"replica {replica.id}{where}"
    state = replica.state
    if state == Replica.State.READY:
        if replica.node and not replica.node_alive:
            return "lost", f"node {replica.node} lost", f"{name} is on a node that stopped reporting"
        if routed:
            return "routed", f"replica {replica.id} does not answer", f"{name} does not answer; waiting for it"
        return "unrouted", "ready, being routed", f"{name} is ready, not yet routed"
    if state == Replica.State.STARTING:
        return "starting", "starting", f"{name} is starting"
    if state == Replica.State.FETCHING:
        percent = replica.percent or "(progress not reported yet)"
        return "fetching", f"fetching {percent}", f"{name} is fetching {percent}"
    if state == Replica.State.PENDING:
        reason = _first_line(replica.reason)
        return "pending", "pending", f"{name} is pending" + (f": {reason}" if reason else "")
    if state == Replica.State.FAILED and replica.attempts < FAILURES_WAITED:
        reason = _first_line(replica.reason)
        return (
            "retrying",
            "failed, starting again",
            f"{name} failed and is started again" + (f": {reason}" if reason else ""),
        )
    return "", "", ""


def judge(name: str, fewest: int | None, most: int | None, replicas: list[ReplicaRow], routed: set[int]) -> Prospect:
    """Whether a request for `name`, which has no usable replica, should wait for one."""
    if most is None:
        return Prospect(CANNOT, "not in the catalog", f"{name} is no longer in the catalog")
    if most == 0:
        return Prospect(CANNOT, "turned off", f"{name} may run no replica (its most is 0)")
    coming = []
    for replica in replicas:
        kind, status, clause = _said(replica, replica.id in routed)
        if kind:
            coming.append((NEAREST.index(kind), status, clause))
    if coming:
        coming.sort(key=lambda entry: entry[0])
        return Prospect(CAN_WAKE, coming[0][1], f"No replica of {name} is ready: " + "; ".join(c for _, _, c in coming))
    failed = [r for r in replicas if r.state == Replica.State.FAILED]
    if failed:
        said = "; ".join(
            f"replica {r.id}{f' on {r.node}' if r.node else ''} failed {r.attempts} times in a row: "
            f"{_first_line(r.reason) or 'no reason given'}"
            for r in failed
        )
        return Prospect(CANNOT, "failed", f"No replica of {name} is ready, and none is on its way: {said}")
    if fewest == 0:
        return Prospect(CAN_WAKE, "scaled to zero, waking", f"{name} is scaled to zero and is being woken")
    return Prospect(CAN_WAKE, "being placed", f"No replica of {name} is placed yet; placement runs every few seconds")


def read(names: list[str], routed: dict[str, set[int]]) -> dict[str, Prospect]:
    """The prospects of these models, from the database and the nodes' progress in Redis."""
    scaling = {
        name: (fewest, most)
        for name, fewest, most in Model.objects.filter(name__in=names).values_list("name", "scaling_min", "scaling_max")
    }
    heard_since = time.time() - settings.HEARTBEAT_S * settings.HEARTBEATS_MISSED
    rows: dict[str, list[ReplicaRow]] = {name: [] for name in names}
    fields = ("model_name", "pk", "state", "reason", "attempts", "node__name", "node__last_heartbeat", "source")
    client = None
    for model, pk, state, reason, attempts, node, heartbeat, source in (
        Replica.objects.filter(model_name__in=names).exclude(state=Replica.State.STOPPING).values_list(*fields)
    ):
        percent = None
        if state == Replica.State.FETCHING and node:
            client = client or redis_client()
            percent = fetched_percent(client, source, node)
        alive = heartbeat is not None and heartbeat.timestamp() >= heard_since
        rows[model].append(ReplicaRow(pk, state, reason, attempts, node or "", alive, percent))
    out = {}
    for name in names:
        fewest, most = scaling.get(name, (None, None))
        out[name] = judge(name, fewest, most, rows[name], routed.get(name, set()))
    return out


def fetched_percent(client, source: str, node: str) -> str | None:
    """How far the node is with the replica's weights, as the agent reports it; None when it has not said."""
    try:
        snapshot = progress.read_one(client, node, source)
    except redis.RedisError:  # progress is a courtesy here; Redis away must not fail the request
        return None
    if not snapshot or not snapshot.get("bytes_total"):
        return None
    return f"{progress.percent(snapshot):.0f}%"
