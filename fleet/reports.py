"""What nodes report: the state of each replica they run, and in their heartbeats which ones they run.

A report is applied to its replica row (a failure counted, a stop ending it); a
heartbeat's list is kept in Redis for the next reconcile pass, which sends again a
start that was lost and tells a node to stop what is not placed there.
"""

from __future__ import annotations

import json
import time

from celery import current_app
from django.conf import settings
from django.db import connection, transaction

from contracts import tasks

from .live import redis_client
from .models import Node, Replica
from .orders import send_stop
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
