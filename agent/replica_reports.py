"""How a node tells the control plane about its replicas: signed reports, and repeats posted in Redis.

Used by the supervisor (every change, and each replica's state again every minute)
and by the engine tasks (a fetch that failed, a stop of a replica this node does not know).
Each report is signed with the node's key (contracts.signing `sign_message`), never
carrying its token; its sequence number is when it was signed, so the control plane can
tell a late report from the latest one without a counter in Redis.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

from celery import current_app

from contracts import signing
from contracts.tasks import CONTROL_QUEUE, REPLICA_REPORT, ReplicaReport, post_report

from . import progress, runtime

log = logging.getLogger("agent.supervisor")

# (replica id, state, endpoint, reason)
Report = Callable[[int, str, str, str], None]


def celery_report(key: str) -> Report:
    """The reporter of this node, signing with `key` (the node's token hash, runtime.key())."""
    node = runtime.node_name()

    def signed(replica_id: int, state: str, endpoint: str, reason: str, role: str = "") -> dict:
        # An engine's last lines may hold a NUL, which the control plane refuses in any text.
        body = ReplicaReport(replica=replica_id, state=state, endpoint=endpoint, reason=reason.replace("\x00", ""))
        if role:
            body["role"] = role  # "worker": this node's share of a replica across several (contracts/groups.py)
        return signing.sign_message(key, REPLICA_REPORT, node, body)

    def report(replica_id: int, state: str, endpoint: str, reason: str, role: str = "") -> None:
        message = signed(replica_id, state, endpoint, reason, role)
        current_app.send_task(REPLICA_REPORT, args=[message], queue=CONTROL_QUEUE)

    def again(replica_id: int, state: str, endpoint: str, reason: str, role: str = "") -> None:
        # Nothing new: posted for the control plane's next collection, not a message of its own.
        message = json.dumps(signed(replica_id, state, endpoint, reason, role))
        post_report(progress.redis_client(), current_app.send_task, node, replica_id, message)

    report.again = again
    return report
