"""The reconcile pass: snapshot the fleet and the catalog, `place`, apply the plan.

The rules are in `fleet.placement`; this module only reads rows into snapshots,
writes the plan back, and sends the agents their work once it is saved.
"""

from __future__ import annotations

import json
import logging
import time
from datetime import datetime, timedelta

import redis
from celery import current_app
from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from catalog.models import Model
from contracts import credentials, signing, tasks
from contracts.engine_args import kind_args

from . import autoscale, drain
from .live import redis_client
from .models import Fetch, Node, Replica, heard_from_lately
from .placement import HOLDING_WEIGHTS, MAKING_ROOM, ModelView, NodeView, Plan, ProfileView, ReplicaView, Scaling, place

log = logging.getLogger(__name__)

# A failed replica is started again after this many seconds, doubled per failure in a row.
RETRY_BASE_S = 10
RETRY_MAX_S = 600
# A stop that was sent and never answered is sent again after this long.
STOP_RESEND_S = 60
LOCK_NAME = "fleet:reconcile"
# A pass takes well under a second; a lock older than this is a pass that died or hangs.
LOCK_TIMEOUT_S = 60
# pg_advisory_xact_lock's key for a pass ("llmgw" as digits): see reconcile_unlocked.
PASS_LOCK_KEY = 0x6C6C6D6777


def retry_delay(attempts: int) -> timedelta:
    """How long a replica that failed `attempts` times in a row waits before its next start."""
    return timedelta(seconds=min(RETRY_MAX_S, RETRY_BASE_S * 2 ** max(attempts - 1, 0)))


def fetched_sources() -> list[tuple[int, str]]:
    """(node id, source) for every fetch a node reported complete: weights it already holds."""
    return list(Fetch.objects.filter(state=Fetch.State.COMPLETE).values_list("node_id", "source"))


def node_views(nodes: list[Node], replicas: list[Replica], now: datetime) -> list[NodeView]:
    holds: dict[int, set[str]] = {}
    for r in replicas:
        if r.node_id and r.state in HOLDING_WEIGHTS:
            holds.setdefault(r.node_id, set()).add(r.source)
    for node_id, source in fetched_sources():
        holds.setdefault(node_id, set()).add(source)
    return [
        NodeView(
            name=n.name,
            ready=heard_from_lately(n.last_heartbeat, now),
            draining=n.draining,
            engines=frozenset(n.engines or ()),
            engines_unusable=dict(n.engines_unusable or {}),
            memory_gb=n.memory_gb,
            gpus=len(n.gpus or ()),
            labels=dict(n.labels or {}),
            holds=frozenset(holds.get(n.pk, ())),
        )
        for n in nodes
    ]


def model_views() -> list[ModelView]:
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
                    args=tuple(p.args or ()),
                    weight=p.weight,
                    priority=p.priority,
                    min_memory_gb=p.min_memory_gb,
                    node_selector=dict(p.node_selector or {}),
                    gpus=p.gpus,
                )
                for p in m.profiles.all()
            ),
        )
        for m in Model.objects.prefetch_related("profiles")
    ]


def replica_views(replicas: list[Replica], node_names: dict[int, str]) -> list[ReplicaView]:
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
        )
        for r in replicas
    ]


def send_start(replica: Replica) -> None:
    node = replica.node
    # The model's kind travels as engine arguments (an embedding model is started with
    # llama.cpp's --embedding): inside the signed arguments, and checked by the node's allow-list.
    kind = Model.objects.filter(name=replica.model_name).values_list("kind", flat=True).first() or "chat"
    engine_args = list(replica.args) + kind_args(replica.engine, kind, replica.args)
    args = [replica.pk, replica.source, replica.engine, engine_args]
    # The name the gateway forwards as "model": vLLM refuses any other than the one it serves.
    # The nonce tells this replica's engine secret from an earlier replica's of the same id
    # (contracts.credentials); not secret itself, the node's token is.
    extra = {"model": replica.model_name, "nonce": credentials.replica_nonce(replica.created)}
    kwargs = signing.with_proof(node.token_hash, tasks.START_REPLICA, node.name, args, extra)
    current_app.send_task(tasks.START_REPLICA, args=args, kwargs=kwargs, queue=tasks.node_queue(node.name))


def send_stop(replica_id: int, node_name: str) -> None:
    key = Node.objects.filter(name=node_name).values_list("token_hash", flat=True).first() or ""
    args = [replica_id]
    kwargs = signing.with_proof(key, tasks.STOP_REPLICA, node_name, args)
    current_app.send_task(tasks.STOP_REPLICA, args=args, kwargs=kwargs, queue=tasks.node_queue(node_name))


def stop(replica: Replica, reason: str = "", tell: bool = True) -> None:
    """Mark a replica stopping and tell its node once that is committed; the node's `stopped` deletes it.

    Not `tell`: the node is told by a later pass, once the replica has drained (fleet/drain.py).
    """
    replica.enter(Replica.State.STOPPING, reason)
    replica.save()
    if tell:
        transaction.on_commit(lambda r=replica.pk, n=replica.node.name: send_stop(r, n))


def reconcile(now: datetime | None = None, models: list[ModelView] | None = None) -> Plan | None:
    """One pass; None when another pass holds the lock (it will see the same rows).

    `models` is the catalog as snapshots, read from the catalog app when not given.
    """
    client = redis.Redis.from_url(settings.REDIS_URL)
    lock = client.lock(LOCK_NAME, timeout=LOCK_TIMEOUT_S, blocking_timeout=0)
    if not lock.acquire(blocking=False):
        if not _break_foreign_lock(client):
            return None
        if not lock.acquire(blocking=False):
            return None
    started = time.monotonic()
    try:
        return reconcile_unlocked(now or timezone.now(), models)
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
def reconcile_unlocked(now: datetime, models: list[ModelView] | None = None) -> Plan:
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
    replicas = list(Replica.objects.select_related("node").select_for_update(of=("self",)))
    by_id = {r.pk: r for r in replicas}
    # Each model's count for this pass, between its fewest and most, from the gateway's load.
    models = autoscale.apply(models, replicas, now)
    plan = place(node_views(nodes, replicas, now), models, replica_views(replicas, node_names))
    autoscale.made_room(plan)
    ready_nodes = {n.name for n in nodes if heard_from_lately(n.last_heartbeat, now)}
    running = running_on(sorted(ready_nodes))

    Replica.objects.filter(pk__in=plan.forget).delete()
    stopping = [r.pk for r in replicas if r.state == Replica.State.STOPPING]
    serving_stopped = any(by_id[i].state == Replica.State.READY for i in plan.stop)
    # Requests in flight per replica, read only when a replica that serves is stopped or draining.
    in_flight = autoscale.read_load()[1] if serving_stopped or stopping else {}
    draining = drain.draining(stopping)
    for replica_id in plan.stop:
        replica = by_id[replica_id]
        busy = replica.state == Replica.State.READY and drain.hold_stop(replica_id, in_flight.get(replica_id, 0))
        stop(replica, plan.stop_reasons.get(replica_id, ""), tell=not busy)
        if replica_id in plan.stop_reasons:
            log.info(
                "replica %s of %s stopped: %s", replica_id, by_id[replica_id].model_name, plan.stop_reasons[replica_id]
            )

    for a in plan.assign:
        replica = by_id[a.replica] if a.replica is not None else Replica(model_name=a.model)
        replica.profile_name = a.profile.name
        replica.node = by_name[a.node]
        replica.source = a.source
        replica.engine = a.profile.engine
        replica.args = list(a.profile.args)
        replica.memory_gb = a.profile.min_memory_gb
        replica.gpus = a.profile.gpus
        replica.endpoint = ""
        if not replica.cause:
            replica.cause = a.cause
        replica.enter(Replica.State.PENDING)
        replica.save()
        transaction.on_commit(lambda r=replica: send_start(r))

    for u in plan.unplaced:
        replica = by_id[u.replica] if u.replica is not None else Replica(model_name=u.model)
        replica.node = None
        replica.endpoint = ""
        replica.cause = replica.cause or u.cause
        replica.enter(Replica.State.PENDING, u.reason)
        replica.save()

    handled = set(plan.forget) | set(plan.stop) | {a.replica for a in plan.assign} | {u.replica for u in plan.unplaced}
    for replica in replicas:
        if replica.pk in handled or replica.node_id is None or node_names[replica.node_id] not in ready_nodes:
            continue
        waited = now - replica.since
        if replica.state == Replica.State.FAILED and waited >= retry_delay(replica.attempts):
            # Same node: it may hold the weights, and a transient failure there is the likely one.
            replica.enter(Replica.State.PENDING, f"starting again after: {replica.reason}")
            replica.save()
            transaction.on_commit(lambda r=replica: send_start(r))
        elif replica.pk in draining:
            if drain.drained(replica.pk, waited.total_seconds(), in_flight.get(replica.pk, 0)):
                replica.since = now
                replica.save(update_fields=["since"])
                transaction.on_commit(lambda r=replica.pk, n=replica.node.name: send_stop(r, n))
        elif replica.state == Replica.State.STOPPING and waited >= timedelta(seconds=STOP_RESEND_S):
            replica.since = now
            replica.save(update_fields=["since"])
            transaction.on_commit(lambda r=replica.pk, n=replica.node.name: send_stop(r, n))
        elif (
            replica.state == Replica.State.PENDING
            and waited >= timedelta(seconds=START_RESEND_S)
            and node_names[replica.node_id] in running
            and replica.pk not in running[node_names[replica.node_id]]
        ):
            # No answer, and its node does not run it: the start was lost (a broker restarted
            # without persistence, a worker killed between commit and publish). A start is
            # idempotent on the node, so one that was only slow costs nothing.
            log.info("replica %s: no answer to its start for %s, sent again", replica.pk, waited)
            replica.since = now
            replica.save(update_fields=["since"])
            transaction.on_commit(lambda r=replica: send_start(r))
    _stop_extras(running, by_name)
    return plan


def _stop_extras(running: dict[str, set[int]], by_name: dict[str, Node]) -> None:
    """Tell a node to stop a replica it runs that is not its (deleted, or moved while it was away)."""
    if not running:
        return
    theirs = set(Replica.objects.filter(node__isnull=False).values_list("node_id", "pk"))
    client = redis_client()
    for name, ids in running.items():
        for replica_id in ids:
            if (by_name[name].pk, replica_id) in theirs:
                continue
            # Once a STOP_RESEND_S, not on every pass until the node has stopped it.
            if client.set(f"llmgw:extra-stop:{name}:{replica_id}", "1", nx=True, ex=STOP_RESEND_S):
                log.info("replica %s runs on %s, which it is not placed on: told to stop", replica_id, name)
                transaction.on_commit(lambda r=replica_id, n=name: send_stop(r, n))


REPORTED_STATES = set(tasks.REPLICA_STATES)
# States whose report, said again, changes nothing: every failure counts, and stopped ends a replica.
SAME_AGAIN_STATES = REPORTED_STATES - {"failed", "stopped"}


def said_before(row: tuple | None, state: str, endpoint: str, reason: str) -> str | None:
    """What to log when a replica, as (state, endpoint, reason, attempts), is already as reported; None when
    the report must be applied.

    Three reports a node every few seconds, nearly all repeating the last: one read
    tells, without a lock or a write. A failure always counts, and stopped ends a
    replica, so those two are never "as before".
    """
    if row is None or state not in SAME_AGAIN_STATES:
        return None
    if row[0] == Replica.State.STOPPING:
        return "ignored: the replica is stopping"
    same = tuple(row[:3]) == (state, endpoint if state == "ready" else "", reason[:4000])
    return f"{state}, as before" if same and (state != "ready" or row[3] == 0) else None


def repeated_report(token_hash: str, replica_id: int, state: str, endpoint: str, reason: str) -> str | None:
    """said_before for a report as it arrives: the token and the replica checked in one query.

    Plain SQL: at a thousand nodes this runs 200 times a second, and building the
    query through the ORM costs ten times what the database does.
    """
    if state not in SAME_AGAIN_STATES:
        return None
    replica, node = Replica._meta.db_table, Node._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT r.state, r.endpoint, r.reason, r.attempts FROM {replica} r JOIN {node} n ON n.id = r.node_id "
            "WHERE r.id = %s AND n.token_hash = %s",
            [replica_id, token_hash],
        )
        return said_before(cursor.fetchone(), state, endpoint, reason)


def record_report(node: Node, replica_id: int, state: str, endpoint: str, reason: str, seq: int = 0) -> str:
    """Apply what a node's agent says about a replica; returns what was done, for the log.

    `seq` is the report's order on the node; one older than a report already applied
    (a `starting` delivered after a `ready`) is ignored. 0 is an unnumbered report.
    """
    if state not in REPORTED_STATES:
        return f"ignored: {state!r} is not a state an agent reports"
    if state in SAME_AGAIN_STATES:
        row = Replica.objects.filter(pk=replica_id, node_id=node.pk).values_list(
            "state", "endpoint", "reason", "attempts"
        )
        if said := said_before(row.first(), state, endpoint, reason):
            return said
    with transaction.atomic():
        replica = Replica.objects.select_for_update().filter(pk=replica_id).first()
        if replica is None or replica.node_id != node.pk:
            if state != "stopped":
                # The node runs an engine nobody wants there: the replica was deleted
                # or moved while the node was away.
                transaction.on_commit(lambda: send_stop(replica_id, node.name))
                return "told to stop: the replica is not on this node"
            return "ignored: the replica is not on this node"
        if seq and not _newest_report(node.name, replica_id, seq):
            return f"ignored: report {seq} is older than one already applied"
        if state == "stopped":
            if replica.state == Replica.State.STOPPING:
                replica.delete()
                if replica.reason.startswith(MAKING_ROOM):
                    # A model waits for this room: placed now, not at the next beat.
                    transaction.on_commit(lambda: current_app.send_task(tasks.RECONCILE, queue=tasks.CONTROL_QUEUE))
                return "deleted: stopped as asked"
            replica.attempts += 1
            replica.enter(Replica.State.FAILED, reason or "the engine stopped without being asked to")
            replica.save()
            return "failed: stopped without being asked"
        if replica.state == Replica.State.STOPPING:
            # A late report never undoes a stop.
            return "ignored: the replica is stopping"
        if state == "failed":
            replica.attempts += 1
        elif state == "ready":
            replica.attempts = 0
        replica.enter(state, reason[:4000], endpoint if state == "ready" else "")
        replica.save()
        return state


# The highest report number applied for a replica, set only upward, in one step on the server.
_NEWER = """
local last = tonumber(redis.call('get', KEYS[1]) or '0')
if tonumber(ARGV[1]) <= last then return 0 end
redis.call('set', KEYS[1], ARGV[1], 'EX', ARGV[2])
return 1
"""
REPORT_SEQ_KEEP_S = 30 * 24 * 3600


def _newest_report(node_name: str, replica_id: int, seq: int) -> bool:
    """Whether this report is newer than every one applied for the replica (and now the newest)."""
    key = "llmgw:applied-" + tasks.report_seq_key(node_name, replica_id).removeprefix("llmgw:")
    return bool(redis_client().eval(_NEWER, 1, key, seq, REPORT_SEQ_KEEP_S))


# --- what nodes say they run --------------------------------------------------------------

RUNNING_PREFIX = "llmgw:node-running:"
# A start that has had no answer for this long is sent again, unless the node says it runs it.
START_RESEND_S = 60


def record_running(node_name: str, replica_ids: list) -> None:
    """Keep what a node's heartbeat says it runs, for the next reconcile pass."""
    ids = sorted({int(i) for i in replica_ids if isinstance(i, int) and not isinstance(i, bool)})
    value = json.dumps({"at": time.time(), "replicas": ids})
    redis_client().set(RUNNING_PREFIX + node_name, value, ex=settings.HEARTBEAT_S * settings.HEARTBEATS_MISSED)


def running_on(node_names: list[str]) -> dict[str, set[int]]:
    """{node: replica ids} from each node's latest heartbeat, for the nodes that sent one lately."""
    if not node_names:
        return {}
    out = {}
    for name, raw in zip(node_names, redis_client().mget([RUNNING_PREFIX + n for n in node_names]), strict=True):
        if raw:
            try:
                out[name] = set(json.loads(raw)["replicas"])
            except (ValueError, KeyError, TypeError):
                continue
    return out
