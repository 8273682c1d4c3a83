"""The reconcile pass: snapshot the fleet and the catalog, `place`, apply the plan.

The rules are in `fleet.placement`; this module only reads rows into snapshots,
writes the plan back, and sends the agents their work once it is saved.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime, timedelta

import redis
from celery import current_app
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from contracts import signing, tasks

from .models import Fetch, Node, Replica, heard_from_lately
from .placement import HOLDING_WEIGHTS, ModelView, NodeView, Plan, ProfileView, ReplicaView, place

log = logging.getLogger(__name__)

# A failed replica is started again after this many seconds, doubled per failure in a row.
RETRY_BASE_S = 10
RETRY_MAX_S = 600
# A stop that was sent and never answered is sent again after this long.
STOP_RESEND_S = 60
LOCK_NAME = "fleet:reconcile"
# A pass takes well under a second; a lock older than this is a pass that died or hangs.
LOCK_TIMEOUT_S = 60


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
            memory_gb=n.memory_gb,
            gpus=len(n.gpus or ()),
            labels=dict(n.labels or {}),
            holds=frozenset(holds.get(n.pk, ())),
        )
        for n in nodes
    ]


def model_views() -> list[ModelView]:
    # Imported here: the catalog app depends on the fleet (its serve page reads
    # nodes), and the fleet only needs the catalog while reconciling.
    from catalog.models import Model

    return [
        ModelView(
            name=m.name,
            source=m.source,
            replicas=m.scaling_min,
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
    args = [replica.pk, replica.source, replica.engine, list(replica.args)]
    # The name the gateway forwards as "model": vLLM refuses any other than the one it serves.
    kwargs = signing.with_proof(node.token_hash, tasks.START_REPLICA, node.name, args, {"model": replica.model_name})
    current_app.send_task(tasks.START_REPLICA, args=args, kwargs=kwargs, queue=tasks.node_queue(node.name))


def send_stop(replica_id: int, node_name: str) -> None:
    key = Node.objects.filter(name=node_name).values_list("token_hash", flat=True).first() or ""
    args = [replica_id]
    kwargs = signing.with_proof(key, tasks.STOP_REPLICA, node_name, args)
    current_app.send_task(tasks.STOP_REPLICA, args=args, kwargs=kwargs, queue=tasks.node_queue(node_name))


def stop(replica: Replica, reason: str = "") -> None:
    """Mark a replica stopping and tell its node once that is committed; the node's `stopped` deletes it."""
    replica.enter(Replica.State.STOPPING, reason)
    replica.save()
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
    if models is None:
        models = model_views()
    nodes = list(Node.objects.all())
    by_name = {n.name: n for n in nodes}
    node_names = {n.pk: n.name for n in nodes}
    replicas = list(Replica.objects.select_related("node"))
    by_id = {r.pk: r for r in replicas}
    plan = place(node_views(nodes, replicas, now), models, replica_views(replicas, node_names))
    ready_nodes = {n.name for n in nodes if heard_from_lately(n.last_heartbeat, now)}

    Replica.objects.filter(pk__in=plan.forget).delete()
    for replica_id in plan.stop:
        stop(by_id[replica_id])

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
        replica.enter(Replica.State.PENDING)
        replica.save()
        transaction.on_commit(lambda r=replica: send_start(r))

    for u in plan.unplaced:
        replica = by_id[u.replica] if u.replica is not None else Replica(model_name=u.model)
        replica.node = None
        replica.endpoint = ""
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
        elif replica.state == Replica.State.STOPPING and waited >= timedelta(seconds=STOP_RESEND_S):
            replica.since = now
            replica.save(update_fields=["since"])
            transaction.on_commit(lambda r=replica.pk, n=replica.node.name: send_stop(r, n))
    return plan


REPORTED_STATES = set(tasks.REPLICA_STATES)


def record_report(node: Node, replica_id: int, state: str, endpoint: str, reason: str) -> str:
    """Apply what a node's agent says about a replica; returns what was done, for the log."""
    if state not in REPORTED_STATES:
        return f"ignored: {state!r} is not a state an agent reports"
    with transaction.atomic():
        replica = Replica.objects.select_for_update().filter(pk=replica_id).first()
        if replica is None or replica.node_id != node.pk:
            if state != "stopped":
                # The node runs an engine nobody wants there: the replica was deleted
                # or moved while the node was away.
                transaction.on_commit(lambda: send_stop(replica_id, node.name))
                return "told to stop: the replica is not on this node"
            return "ignored: the replica is not on this node"
        if state == "stopped":
            if replica.state == Replica.State.STOPPING:
                replica.delete()
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
