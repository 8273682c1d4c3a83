import logging

from celery import shared_task

from . import enrolment

log = logging.getLogger(__name__)


@shared_task(name="fleet.heartbeat", ignore_result=True)
def heartbeat(token: str, facts: dict) -> None:
    """A node's agent reporting its facts; arrives on the control queue."""
    node = enrolment.record_heartbeat(token, facts)
    if node is None:
        # Said once per heartbeat in the log, never acted on: a stray worker
        # cannot enrol itself or speak for another node.
        log.warning("heartbeat refused: the token does not enrol a node called %r", facts.get("node"))


@shared_task(name="fleet.reconcile", ignore_result=True)
def reconcile() -> None:
    """Keep every catalog model at its replica count; on a beat and after each catalog change."""
    from . import reconcile as reconciling

    reconciling.reconcile()


@shared_task(name="fleet.replica_report", ignore_result=True)
def replica_report(token: str, replica_id: int, state: str, endpoint: str = "", reason: str = "") -> None:
    """A node's agent saying what became of a replica it runs; arrives on the control queue."""
    from . import reconcile as reconciling

    node = enrolment.node_for_token(token)
    if node is None:
        log.warning("replica report refused: the token does not enrol a node (replica %s)", replica_id)
        return
    outcome = reconciling.record_report(node, int(replica_id), str(state), str(endpoint or ""), str(reason or ""))
    log.info("replica %s on %s reported %s: %s", replica_id, node.name, state, outcome)
