"""How a node tells the control plane about its replicas: numbered reports, and repeats posted in Redis.

Used by the supervisor (every change, and each replica's state again every minute)
and by the engine tasks (a fetch that failed, a stop of a replica this node does not know).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

from celery import current_app

from contracts.tasks import CONTROL_QUEUE, REPLICA_REPORT, REPORTS_KEY, post, report_seq_key

from . import progress, runtime

# A replica's report counter outlives a month without reports; the control plane's too.
REPORT_SEQ_KEEP_S = 30 * 24 * 3600

log = logging.getLogger("agent.supervisor")

# (replica id, state, endpoint, reason)
Report = Callable[[int, str, str, str], None]


def celery_report(token: str) -> Report:
    def report(replica_id: int, state: str, endpoint: str, reason: str) -> None:
        # Numbered, so the control plane can tell a late report from the latest one.
        seq = report_seq(replica_id)
        current_app.send_task(
            REPLICA_REPORT, args=[token, replica_id, state, endpoint, reason], kwargs={"seq": seq}, queue=CONTROL_QUEUE
        )

    def again(replica_id: int, state: str, endpoint: str, reason: str) -> None:
        # Nothing new: posted for the control plane's next collection, not a message of its own.
        entry = json.dumps([token, replica_id, state, endpoint, reason, report_seq(replica_id)])
        post(progress.redis_client(), current_app.send_task, REPORTS_KEY, str(replica_id), entry)

    report.again = again
    return report


def report_seq(replica_id: int) -> int:
    """The next number of this replica's reports on this node; 0 (applied whatever came before) without Redis."""
    try:
        key = report_seq_key(runtime.node_name(), replica_id)
        client = progress.redis_client()
        seq = client.incr(key)
        client.expire(key, REPORT_SEQ_KEEP_S)
        return int(seq)
    except Exception:
        log.warning("could not number the report of replica %s; it is sent unnumbered", replica_id)
        return 0
