"""The reconcile pass: snapshot the fleet and the catalog, `place`, apply the plan.

The rules are in `fleet.placement`; this module only reads rows into snapshots,
writes the plan back, and sends the agents their work once it is saved
(`fleet.orders`). What the agents report back is applied in `fleet.reports`.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime, timedelta

import redis
from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from catalog.models import Model
from mirror.readiness import source_being_written

from . import autoscale, drain
from . import memory as measured_memory
from .live import listening_since, redis_client
from .models import Fetch, Node, Replica, ReplicaShare, heard_from_lately
from .orders import send_start, send_stop, send_stop_workers
from .placement import HOLDING_WEIGHTS, ModelView, NodeView, Plan, ProfileView, ReplicaView, Scaling, place

# What nodes report is handled in fleet/reports.py; fleet/tasks.py and the tests still reach it here.
from .reports import record_report, record_running, repeated_report, running_on, said_before  # noqa: F401

log = logging.getLogger(__name__)

# A failed replica is started again after this many seconds, doubled per failure in a row.
RETRY_BASE_S = 10
RETRY_MAX_S = 600
# A stop that was sent and never answered is sent again after this long.
STOP_RESEND_S = 60
# A start that has had no answer for this long is sent again, unless the node says it runs it.
START_RESEND_S = 60
# States in which a node lists its replica in its heartbeats: one it leaves out is started again.
# Not fetching: the agent wants a replica only once its weights are fetched (agent/engine_tasks.py).
RESENT_STATES = (Replica.State.PENDING, Replica.State.STARTING, Replica.State.READY)
LOCK_NAME = "fleet:reconcile"
# A pass takes well under a second; a lock older than this is a pass that died or hangs. Short: a
# control host lost mid-pass (two control hosts, docs/fleet.md) holds placement up this long, and a
# pass that outlives it is still kept apart from the next by PostgreSQL's lock (reconcile_unlocked).
LOCK_TIMEOUT_S = 10
# pg_advisory_xact_lock's key for a pass ("llmgw" as digits): see reconcile_unlocked.
PASS_LOCK_KEY = 0x6C6C6D6777


def retry_delay(attempts: int) -> timedelta:
    """How long a replica that failed `attempts` times in a row waits before its next start."""
    return timedelta(seconds=min(RETRY_MAX_S, RETRY_BASE_S * 2 ** max(attempts - 1, 0)))


def unanswered_after(state: str) -> timedelta:
    """How long a replica in `state` may be missing from its node's heartbeats before it is started again.

    Pending: a start may be slow to arrive. Later states were reported by the node, which
    held the replica then; once a node's running list (kept HEARTBEAT_S * HEARTBEATS_MISSED)
    is younger than the report, one that leaves it out means the node does not run it.
    """
    if state == Replica.State.PENDING:
        return timedelta(seconds=START_RESEND_S)
    return timedelta(seconds=settings.HEARTBEAT_S * settings.HEARTBEATS_MISSED)


def fetched_sources() -> list[tuple[int, str]]:
    """(node id, source) for every fetch a node reported complete: weights it already holds."""
    return list(Fetch.objects.filter(state=Fetch.State.COMPLETE).values_list("node_id", "source"))


def heard(node: Node, now: datetime, heard_since: datetime | None = None) -> bool:
    """Whether a node was heard from lately; silence before `heard_since` (live.listening_since) does not count."""
    last = node.last_heartbeat
    if last is not None and heard_since is not None:
        last = max(last, heard_since)
    return heard_from_lately(last, now)


def node_views(
    nodes: list[Node], replicas: list[Replica], now: datetime, heard_since: datetime | None = None
) -> list[NodeView]:
    holds: dict[int, set[str]] = {}
    for r in replicas:
        if r.node_id and r.state in HOLDING_WEIGHTS:
            holds.setdefault(r.node_id, set()).add(r.source)
    for node_id, source in fetched_sources():
        holds.setdefault(node_id, set()).add(source)
    return [
        NodeView(
            name=n.name,
            ready=heard(n, now, heard_since),
            draining=n.draining,
            engines=frozenset(n.engines or ()),
            engines_unusable=dict(n.engines_unusable or {}),
            memory_gb=n.memory_gb,
            gpus=len(n.gpus or ()),
            labels=dict(n.labels or {}),
            holds=frozenset(holds.get(n.pk, ())),
            rpc=n.rpc,
            rpc_head=n.rpc_head,
        )
        for n in nodes
    ]


def model_views() -> list[ModelView]:
    # The most each profile's replicas have been measured to use: placement asks for it once it is more.
    peaks = measured_memory.peaks()
    return [
        ModelView(
            name=m.name,
            source=m.source,
            replicas=m.scaling_min,
            scaling=Scaling(m.scaling_min, m.scaling_max, m.target_load, m.quiet_s, m.idle_s, m.priority),
            profiles=tuple(
                ProfileView(
                    name=p.name,
                    engine=p.engine,
                    # With --parallel N: a change of slots is a change of how the engine runs.
                    args=tuple(p.engine_args()),
                    weight=p.weight,
                    priority=p.priority,
                    min_memory_gb=p.min_memory_gb,
                    node_selector=dict(p.node_selector or {}),
                    gpus=p.gpus,
                    nodes=p.nodes,
                    measured_gb=measured_memory.measured_gb_for(
                        peaks.get((m.name, p.name)), m.source, p.engine, p.engine_args()
                    ),
                )
                for p in m.profiles.all()
            ),
            not_ready=source_being_written(m.source, settings.BYTES_URL),
        )
        for m in Model.objects.prefetch_related("profiles")
    ]


def replica_views(
    replicas: list[Replica], node_names: dict[int, str], measured: dict | None = None, now: datetime | None = None
) -> list[ReplicaView]:
    """`measured` is {replica id: fleet.memory.Measured}, from the nodes' latest heartbeats."""
    measured = measured or {}
    return [
        ReplicaView(
            id=r.pk,
            model=r.model_name,
            profile=r.profile_name,
            node=node_names.get(r.node_id) if r.node_id else None,
            state=r.state,
            memory_gb=r.memory_gb,
            gpus=r.gpus,
            source=r.source,
            engine=r.engine,
            args=tuple(r.args or ()),
            measured_gb=measured[r.pk].host_gb
            if r.pk in measured and r.node_id and measured[r.pk].node == node_names.get(r.node_id)
            else 0,
            shares=tuple((node_names.get(s.node_id, ""), s.memory_gb, s.state) for s in r.shares.all()),
            retry_due=now is None or now - r.since >= retry_delay(r.attempts),
        )
        for r in replicas
    ]


def stop(replica: Replica, reason: str = "", tell: bool = True) -> None:
    """Mark a replica stopping and tell its node once that is committed; the node's `stopped` deletes it.

    Not `tell`: the node is told by a later pass, once the replica has drained (fleet/drain.py).
    """
    replica.enter(Replica.State.STOPPING, reason)
    replica.save()
    if tell:
        tell_stop(replica)


def tell_stop(replica: Replica) -> None:
    """Once committed, tell its node to stop it, and a group's every worker (issue 37)."""
    workers = [s.node.name for s in replica.shares.all()]
    transaction.on_commit(lambda r=replica.pk, n=replica.node.name: send_stop(r, n))
    if workers:
        transaction.on_commit(lambda r=replica.pk, w=workers: send_stop_workers(r, w))


def free_port(node: Node) -> int | None:
    """The lowest port of LLMGW_RPC_PORTS no share on this node uses; None when all are taken."""
    used = set(ReplicaShare.objects.filter(node=node).values_list("port", flat=True))
    low, high = settings.RPC_PORT_RANGE
    return next((port for port in range(low, high + 1) if port not in used), None)


def _assign_shares(replica: Replica, a, by_name: dict[str, Node]) -> str | None:
    """Keep a group's workers as its shares, each with a port of its node; why not, when a node has none free."""
    old = [s.node.name for s in replica.shares.all()]
    if old:
        # The group moved (its head was lost): its old workers stop theirs.
        transaction.on_commit(lambda r=replica.pk, w=old: send_stop_workers(r, w))
        replica.shares.all().delete()
    for share in a.shares:
        node = by_name[share.node]
        port = free_port(node)
        if port is None:
            replica.shares.all().delete()
            return f"worker {node.name} has no free port in LLMGW_RPC_PORTS for its share"
        ReplicaShare.objects.create(replica=replica, node=node, share=share.share, memory_gb=share.memory_gb, port=port)
    return None


def reconcile(now: datetime | None = None, models: list[ModelView] | None = None) -> Plan | None:
    """One pass; None when another pass holds the lock (it will see the same rows).

    `models` is the catalog as snapshots, read from the catalog app when not given.
    """
    client = redis_client()
    lock = client.lock(LOCK_NAME, timeout=LOCK_TIMEOUT_S, blocking_timeout=0)
    if not lock.acquire(blocking=False):
        if not _break_foreign_lock(client):
            return None
        if not lock.acquire(blocking=False):
            return None
    started = time.monotonic()
    try:
        # On the clock, not `now`: a pass judged as of another time (the tests' "a minute later") was no gap.
        deadline_s = settings.HEARTBEAT_S * settings.HEARTBEATS_MISSED
        since = listening_since(client, time.time(), gap_s=deadline_s)
        heard_since = datetime.fromtimestamp(since, tz=UTC) if since else None
        return reconcile_unlocked(now or timezone.now(), models, heard_since=heard_since)
    finally:
        try:
            lock.release()
        except redis.exceptions.LockError:
            # Held past its timeout, and maybe taken by another pass that ran beside this one.
            log.warning(
                "the reconcile pass took %.0f s, longer than its lock's %d s: the lock expired while it ran",
                time.monotonic() - started,
                LOCK_TIMEOUT_S,
            )


# A pass always sets the lock with an expiry of LOCK_TIMEOUT_S; a key with none, or a
# longer one, was set by something else (anyone who reaches Redis can SET it) and would
# stop placement for as long as it stays. Checked and removed in one step on the server.
_BREAK_FOREIGN = """
local ttl = redis.call('pttl', KEYS[1])
if ttl == -1 or ttl > tonumber(ARGV[1]) then
  redis.call('del', KEYS[1])
  return ttl
end
return -3
"""


def _break_foreign_lock(client: redis.Redis) -> bool:
    """Remove a lock no reconcile pass could have set; True when there was one."""
    ttl = client.eval(_BREAK_FOREIGN, 1, LOCK_NAME, LOCK_TIMEOUT_S * 1000)
    if ttl == -3:
        return False
    held = "with no expiry" if ttl == -1 else f"for {ttl / 1000:.0f} s more"
    log.warning(
        "the reconcile lock %s was held %s, which no reconcile pass does (each expires in %d s): "
        "it was removed so that placement goes on",
        LOCK_NAME,
        held,
        LOCK_TIMEOUT_S,
    )
    return True


@transaction.atomic
def reconcile_unlocked(
    now: datetime, models: list[ModelView] | None = None, heard_since: datetime | None = None
) -> Plan:
    if connection.vendor == "postgresql":
        # The Redis lock can expire under a pass (one stalled longer than LOCK_TIMEOUT_S) or be
        # deleted by anyone who reaches Redis; then two passes would both read "no replica yet"
        # and both place one. The database's own lock, held to this transaction's end, keeps
        # them in turn. (SQLite's IMMEDIATE transactions take its one write lock at BEGIN.)
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [PASS_LOCK_KEY])
    if models is None:
        models = model_views()
    nodes = list(Node.objects.all())
    by_name = {n.name: n for n in nodes}
    node_names = {n.pk: n.name for n in nodes}
    # Locked to the pass's end: a node's report on one of them waits rather than being
    # overwritten by a pass that read the row before it.
    replicas = list(
        Replica.objects.select_related("node").select_for_update(of=("self",)).prefetch_related("shares__node")
    )
    by_id = {r.pk: r for r in replicas}
    # Each model's count for this pass, between its fewest and most, from the gateway's load.
    models = autoscale.apply(models, replicas, now)
    # What each replica's engine holds now, as its node last measured it (fleet/memory.py).
    measured, _ = measured_memory.latest(n.name for n in nodes)
    plan = place(
        node_views(nodes, replicas, now, heard_since), models, replica_views(replicas, node_names, measured, now)
    )
    autoscale.made_room(plan)
    ready_nodes = {n.name for n in nodes if heard(n, now, heard_since)}
    running = running_on(sorted(ready_nodes))

    in_flight, draining = _forget_and_stop(plan, replicas, by_id, ready_nodes)
    _assign(plan, by_id, by_name)
    _unplace(plan, by_id)
    handled = set(plan.forget) | set(plan.stop) | {a.replica for a in plan.assign} | {u.replica for u in plan.unplaced}
    for replica in replicas:
        if replica.pk in handled or replica.node_id is None or node_names[replica.node_id] not in ready_nodes:
            continue
        _follow_up(replica, now, draining, in_flight, running.get(node_names[replica.node_id]))
    _stop_extras(running, by_name)
    return plan


def _forget_and_stop(
    plan: Plan, replicas: list[Replica], by_id: dict[int, Replica], ready_nodes: set[str]
) -> tuple[dict[int, int], set[int]]:
    """Delete the plan's forgotten replicas and stop its stopped ones; return in-flight counts and the draining."""
    for replica_id in plan.forget:
        # A group forgotten (its head lost): the workers that are still heard from stop their shares.
        workers = [s.node.name for s in by_id[replica_id].shares.all() if s.node.name in ready_nodes]
        if workers:
            transaction.on_commit(lambda r=replica_id, w=workers: send_stop_workers(r, w))
    Replica.objects.filter(pk__in=plan.forget).delete()
    stopping = [r.pk for r in replicas if r.state == Replica.State.STOPPING]
    serving_stopped = any(by_id[i].state == Replica.State.READY for i in plan.stop)
    # Requests in flight per model and replica, read only when a replica that serves is stopped or draining.
    model_load, in_flight = autoscale.read_load() if serving_stopped or stopping else ({}, {})
    draining = drain.draining(stopping)
    for replica_id in plan.stop:
        replica = by_id[replica_id]
        busy = (
            replica.state == Replica.State.READY
            and replica_id not in plan.stop_now
            and drain.hold_stop(
                replica_id, in_flight.get(replica_id, 0), model_load.get(replica.model_name, {}).get("in_flight", 0)
            )
        )
        stop(replica, plan.stop_reasons.get(replica_id, ""), tell=not busy)
        if replica_id in plan.stop_reasons:
            log.info(
                "replica %s of %s stopped: %s", replica_id, by_id[replica_id].model_name, plan.stop_reasons[replica_id]
            )
    return in_flight, draining


def _assign(plan: Plan, by_id: dict[int, Replica], by_name: dict[str, Node]) -> None:
    """Write each assignment of the plan to its replica (a new one for a new replica) and send its start."""
    for a in plan.assign:
        replica = by_id[a.replica] if a.replica is not None else Replica(model_name=a.model)
        replica.profile_name = a.profile.name
        replica.node = by_name[a.node]
        replica.source = a.source
        replica.engine = a.profile.engine
        replica.args = list(a.profile.args)
        replica.memory_gb = a.memory_gb
        replica.gpus = a.profile.gpus
        replica.endpoint = ""
        if not replica.cause:
            replica.cause = a.cause
        # A group says where its shares are and why those nodes; one node says nothing more.
        replica.enter(Replica.State.PENDING, a.explanation)
        replica.save()
        if a.shares or replica.pk in by_id:
            if problem := _assign_shares(replica, a, by_name):
                replica.node = None
                replica.enter(Replica.State.PENDING, problem)
                replica.save()
                continue
        # robust: a start that raises is logged, and the pass's other starts are still sent (issue 34);
        # the one that failed is sent again once its node says it does not run it (START_RESEND_S).
        transaction.on_commit(lambda r=replica: send_start(r), robust=True)


def _unplace(plan: Plan, by_id: dict[int, Replica]) -> None:
    """Leave each replica the plan could not place pending on no node, saying why."""
    for u in plan.unplaced:
        replica = by_id[u.replica] if u.replica is not None else Replica(model_name=u.model)
        replica.node = None
        replica.endpoint = ""
        replica.cause = replica.cause or u.cause
        replica.enter(Replica.State.PENDING, u.reason)
        replica.save()


def _follow_up(
    replica: Replica, now: datetime, draining: set[int], in_flight: dict[int, int], running: set[int] | None
) -> None:
    """Move on a replica the plan left alone on a heard node: retry a failure, finish a drain, resend what went unanswered.

    `running` is what its node last said it runs (None: the node has not said).
    """
    waited = now - replica.since
    if replica.state == Replica.State.FAILED and waited >= retry_delay(replica.attempts):
        # Same node: it may hold the weights, and a transient failure there is the likely one.
        replica.enter(Replica.State.PENDING, f"starting again after: {replica.reason}")
        replica.save()
        transaction.on_commit(lambda r=replica: send_start(r), robust=True)
    elif replica.pk in draining:
        if drain.drained(replica.pk, waited.total_seconds(), in_flight.get(replica.pk, 0)):
            replica.since = now
            replica.save(update_fields=["since"])
            tell_stop(replica)
    elif replica.state == Replica.State.STOPPING and waited >= timedelta(seconds=STOP_RESEND_S):
        replica.since = now
        replica.save(update_fields=["since"])
        tell_stop(replica)
    elif (
        replica.state in RESENT_STATES
        and waited >= unanswered_after(replica.state)
        and running is not None
        and replica.pk not in running
    ):
        # Its node does not run it. Pending: the start was lost (a broker restarted without
        # persistence, a worker killed between commit and publish). Starting or ready: the
        # database was restored from a backup taken while it ran, and it has stopped since
        # (docs/failures.md). A start is idempotent on the node, so one that was only slow costs nothing.
        if replica.state == Replica.State.PENDING:
            log.info("replica %s: no answer to its start for %s, sent again", replica.pk, waited)
            replica.since = now
            replica.save(update_fields=["since"])
        else:
            log.info("replica %s is %s but its node does not run it: started again", replica.pk, replica.state)
            said = f"started again: it was {replica.state}, but its node did not run it"
            replica.enter(Replica.State.PENDING, said, endpoint="")
            replica.save()
        transaction.on_commit(lambda r=replica: send_start(r), robust=True)


def _stop_extras(running: dict[str, set[int]], by_name: dict[str, Node]) -> None:
    """Tell a node to stop a replica it runs that is not its (deleted, or moved while it was away)."""
    if not running:
        return
    theirs = set(Replica.objects.filter(node__isnull=False).values_list("node_id", "pk"))
    theirs |= set(ReplicaShare.objects.values_list("node_id", "replica_id"))
    client = redis_client()
    for name, ids in running.items():
        for replica_id in ids:
            if (by_name[name].pk, replica_id) in theirs:
                continue
            # Once a STOP_RESEND_S, not on every pass until the node has stopped it.
            if client.set(f"llmgw:extra-stop:{name}:{replica_id}", "1", nx=True, ex=STOP_RESEND_S):
                log.info("replica %s runs on %s, which it is not placed on: told to stop", replica_id, name)
                transaction.on_commit(lambda r=replica_id, n=name: send_stop(r, n))
