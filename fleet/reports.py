"""What nodes report: the state of each replica they run, and in their heartbeats which ones they run.

A report is applied to its replica row (a failure counted, a stop ending it); a
heartbeat's list is kept in Redis for the next reconcile pass, which sends again a
start that was lost and tells a node to stop what is not placed there.
"""

from __future__ import annotations

import json
import time
from urllib.parse import urlsplit

from celery import current_app
from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from contracts import signing, tasks

from .live import redis_client
from .models import Node, Replica, ReplicaShare
from .orders import send_stop, send_stop_workers
from .placement import MAKING_ROOM

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


# Where a node enrolled without an address may have its engines: this host only.
LOOPBACK = "127.0.0.1"


def expected_endpoint(address: str, port: int | str) -> str:
    """The one endpoint the control plane routes to for an engine of a node enrolled at `address`."""
    host = address or LOOPBACK
    return f"http://[{host}]:{port}/v1" if ":" in host else f"http://{host}:{port}/v1"


def endpoint_problem(node: Node, endpoint: str) -> str | None:
    """Why a replica reported ready at `endpoint` must not be routed to, in a sentence; None when it may.

    The control plane decides where an engine is: at the address the node was enrolled
    with and a port, and nothing else. A node (or whoever forged its report) that says
    another host, userinfo, a path or a query would have the gateway send a model's
    prompts, and the replica's secret, wherever it liked.
    """
    try:
        port = urlsplit(endpoint).port
    except ValueError:
        port = None
    if port is not None and 1 <= port <= 65535 and endpoint == expected_endpoint(node.address, port):
        return None
    where = f"at {node.address}" if node.address else "without an address, so on this host only"
    return (
        f"Not routed to: its node reported it at {endpoint[:200]!r}, but node {node.name} is enrolled {where}, "
        f"and the gateway routes only to {expected_endpoint(node.address, 'PORT')} "
        "(`manage.py node_token NAME --address HOST` enrols the address; the node's LLMGW_ENGINE_ADVERTISE must name it)."
    )


def repeated_report(node_id: int, replica_id: int, state: str, endpoint: str, reason: str) -> str | None:
    """said_before for a report as it arrives: the replica and its node checked in one query.

    Plain SQL: at a thousand nodes this runs 200 times a second, and building the
    query through the ORM costs ten times what the database does.
    """
    if state not in SAME_AGAIN_STATES:
        return None
    replica = Replica._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT state, endpoint, reason, attempts FROM {replica} WHERE id = %s AND node_id = %s",
            [replica_id, node_id],
        )
        return said_before(cursor.fetchone(), state, endpoint, reason)


def record_report(
    node: Node, replica_id: int, state: str, endpoint: str, reason: str, seq: int = 0, role: str = ""
) -> str:
    """Apply what a node's agent says about a replica; returns what was done, for the log.

    `seq` is the report's order on the node; one older than a report already applied
    (a `starting` delivered after a `ready`) is ignored. 0 is an unnumbered report.
    A `ready` at an endpoint other than the one the node's enrolment allows is a failure
    that says why (endpoint_problem): the replica is never routed there.
    """
    if state not in REPORTED_STATES:
        return f"ignored: {state!r} is not a state an agent reports"
    # A worker's share is not routed to (its head is): its endpoint is nothing to check.
    worker = ReplicaShare.objects.filter(replica_id=replica_id, node=node).exists() if state == "ready" else False
    if state == "ready" and not worker and (problem := endpoint_problem(node, endpoint)):
        state, endpoint, reason = "failed", "", problem
    if state in SAME_AGAIN_STATES:
        row = Replica.objects.filter(pk=replica_id, node_id=node.pk).values_list(
            "state", "endpoint", "reason", "attempts"
        )
        if said := said_before(row.first(), state, endpoint, reason):
            return said
    claimed = None
    try:
        with transaction.atomic():
            replica = Replica.objects.select_for_update().filter(pk=replica_id).first()
            share = None
            if replica is not None and replica.node_id != node.pk:
                share = ReplicaShare.objects.filter(replica=replica, node=node).first()
            if replica is None or (replica.node_id != node.pk and share is None):
                if state != "stopped":
                    # The node runs an engine nobody wants there: the replica was deleted
                    # or moved while the node was away (a worker: its share of a group).
                    if role == "worker":
                        transaction.on_commit(lambda: send_stop_workers(replica_id, [node.name]))
                    else:
                        transaction.on_commit(lambda: send_stop(replica_id, node.name))
                    return "told to stop: the replica is not on this node"
                return "ignored: the replica is not on this node"
            if seq:
                claimed = _claim_report(node.name, replica_id, seq)
                if claimed is None:
                    return f"ignored: report {seq} is older than one already applied"
            if share is not None:
                return _record_share(replica, share, state, reason)
            if state != "stopped" and _lost_a_worker(replica):
                # The head's supervisor starts its engine again, which fails again without the
                # worker: the group stays failed, naming the worker, until placement replaces it.
                return "ignored: the group failed with its worker and is placed again"
            return _apply(replica, state, endpoint, reason)
    except Exception:
        # Not applied (the database went away before the commit, say): the report is given back
        # to be collected again (fleet/tasks.py), and its number must not make it "older" then.
        if claimed is not None:
            _unclaim_report(node.name, replica_id, seq, claimed)
        raise


def _apply(replica: Replica, state: str, endpoint: str, reason: str) -> str:
    """A report on its replica, locked by the caller's transaction; what was done, for the log."""
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


def _lost_a_worker(replica: Replica) -> bool:
    return replica.state == Replica.State.FAILED and replica.shares.filter(state=ReplicaShare.State.FAILED).exists()


def _record_share(replica: Replica, share: ReplicaShare, state: str, reason: str) -> str:
    """A worker's report of its share of a group (issue 37): the group is one replica, and fails with it.

    Any other node's report for the replica is a stranger's, and changes nothing (record_report).
    """
    worker = share.node.name
    if state == "stopped" and replica.state == Replica.State.STOPPING:
        share.delete()
        return "share deleted: stopped as asked"
    if replica.state == Replica.State.STOPPING:
        return "ignored: the replica is stopping"
    if state in ("failed", "stopped"):
        said = reason or "its rpc-server stopped without being asked to"
        share.state, share.reason, share.since = ReplicaShare.State.FAILED, said[:4000], timezone.now()
        share.save()
        replica.attempts += 1
        replica.enter(Replica.State.FAILED, f"worker {worker} failed: {said}"[:4000])
        replica.save()
        return "failed: a worker of the group failed"
    if state != share.state:
        share.state, share.since = state, timezone.now()
    share.reason = ""
    share.save()
    return f"share {state}"


# The highest report number applied for a replica, set only upward, in one step on the server; returns the
# number before (-1: not newer).
# One past ARGV[3] (the latest a node could have signed by now) was written before numbers
# were bounded (issue 33: a forged 1e15 made every genuine later report look old): forgotten.
_NEWER = """
local last = tonumber(redis.call('get', KEYS[1]) or '0')
if last > tonumber(ARGV[3]) then last = 0 end
if tonumber(ARGV[1]) <= last then return -1 end
redis.call('set', KEYS[1], ARGV[1], 'EX', ARGV[2])
return last
"""
REPORT_SEQ_KEEP_S = 30 * 24 * 3600
# Back to the number before, unless a newer report has been applied since.
_UNCLAIM = """
if redis.call('get', KEYS[1]) ~= ARGV[1] then return 0 end
if tonumber(ARGV[2]) == 0 then redis.call('del', KEYS[1]) else redis.call('set', KEYS[1], ARGV[2], 'EX', ARGV[3]) end
return 1
"""


def _seq_key(node_name: str, replica_id: int) -> str:
    return f"llmgw:applied-report-seq:{node_name}:{replica_id}"


def _claim_report(node_name: str, replica_id: int, seq: int) -> int | None:
    """The number applied before this report, now that this one is the newest; None when it is not newer."""
    latest = int((time.time() + signing.CLOCK_SKEW_S) * 1_000_000)
    before = redis_client().eval(_NEWER, 1, _seq_key(node_name, replica_id), seq, REPORT_SEQ_KEEP_S, latest)
    return None if before < 0 else int(before)


def _unclaim_report(node_name: str, replica_id: int, seq: int, before: int) -> None:
    redis_client().eval(_UNCLAIM, 1, _seq_key(node_name, replica_id), seq, before, REPORT_SEQ_KEEP_S)


# --- what nodes say they run --------------------------------------------------------------

RUNNING_PREFIX = "llmgw:node-running:"


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
