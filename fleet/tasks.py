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
