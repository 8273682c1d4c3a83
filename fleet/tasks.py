"""The control plane's tasks for the fleet: what nodes report, and the reconcile pass."""

import logging

from celery import shared_task

from contracts import tasks

from . import enrolment
from . import reconcile as reconciling
from .metrics import RECONCILE
from .models import Fetch

log = logging.getLogger(__name__)


@shared_task(name=tasks.HEARTBEAT, ignore_result=True)
def heartbeat(token: str, facts: tasks.Facts) -> None:
    """A node's agent reporting its facts; arrives on the control queue."""
    node = enrolment.record_heartbeat(token, facts)
    if node is None:
        # Said once per heartbeat in the log, never acted on: a stray worker
        # cannot enrol itself or speak for another node.
        log.warning("heartbeat refused: the token does not enrol a node called %r", facts.get("node"))


@shared_task(name=tasks.RECONCILE, ignore_result=True)
def reconcile() -> None:
    """Keep every catalog model at its replica count; on a beat and after each catalog change."""
    with RECONCILE.time():
        reconciling.reconcile()


@shared_task(name=tasks.REPLICA_REPORT, ignore_result=True)
def replica_report(token: str, replica_id: int, state: str, endpoint: str = "", reason: str = "") -> None:
    """A node's agent saying what became of a replica it runs; arrives on the control queue."""
    node = enrolment.node_for_token(token)
    if node is None:
        log.warning("replica report refused: the token does not enrol a node (replica %s)", replica_id)
        return
    outcome = reconciling.record_report(node, int(replica_id), str(state), str(endpoint or ""), str(reason or ""))
    log.info("replica %s on %s reported %s: %s", replica_id, node.name, state, outcome)


@shared_task(name=tasks.FETCH_FINISHED, ignore_result=True)
def fetch_finished(token: str, report: tasks.FetchReport) -> None:
    """A node's report of how a fetch ended; arrives on the control queue."""
    node = enrolment.node_for_token(token, claimed_name=report.get("node"))
    if node is None:
        log.warning("fetch report refused: the token does not enrol a node called %r", report.get("node"))
        return
    Fetch.objects.record(node, report)
