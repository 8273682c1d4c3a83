"""The control plane's tasks for the fleet: what nodes report, and the reconcile pass."""

import json
import logging

from celery import shared_task

from catalog.models import Model
from contracts import demand, tasks

from . import autoscale, enrolment
from . import memory as measured_memory
from . import reconcile as reconciling
from .live import redis_client
from .metrics import RECONCILE
from .models import Fetch

log = logging.getLogger(__name__)


@shared_task(name=tasks.COLLECT, ignore_result=True)
def collect() -> None:
    """Every heartbeat and repeated report nodes posted since the last collection, in one task.

    See contracts/tasks.py: a Celery message each would cost the control worker a third
    of a core at a thousand nodes. Each entry is checked as its own message would be.
    """
    heartbeats, reports = tasks.take(redis_client())
    for node, raw in heartbeats.items():
        try:
            token, facts = json.loads(raw)
            if not isinstance(facts, dict):
                raise ValueError("the facts are not an object")
        except (ValueError, TypeError) as error:
            log.warning("heartbeat posted for %r dropped: %s", node, error)
            continue
        heartbeat(str(token), facts)
    for replica, raw in reports.items():
        try:
            token, replica_id, state, endpoint, reason, seq = json.loads(raw)
            replica_report(str(token), int(replica_id), state, endpoint, reason, seq=int(seq or 0))
        except (ValueError, TypeError) as error:
            log.warning("report posted for replica %r dropped: %s", replica, error)


@shared_task(name=tasks.HEARTBEAT, ignore_result=True)
def heartbeat(token: str, facts: tasks.Facts) -> None:
    """A node's agent reporting its facts: from a collection, or as a message of its own (older agents)."""
    name = enrolment.record_heartbeat(token, facts)
    if name is None:
        # Said once per heartbeat in the log, never acted on: a stray worker
        # cannot enrol itself or speak for another node.
        log.warning("heartbeat refused: the token does not enrol a node called %r", facts.get("node"))
        return
    if isinstance(facts.get("replicas"), list):
        reconciling.record_running(name, facts["replicas"])
    # What each replica's engine really holds (fleet/memory.py).
    measured_memory.record(name, facts)


@shared_task(name=tasks.RECONCILE, ignore_result=True)
def reconcile() -> None:
    """Keep every catalog model at its replica count; on a beat and after each catalog change."""
    # What nodes posted since the last collection, first. While the control worker was
    # down their heartbeats waited in Redis; a pass that judged by the database alone
    # found every node silent for longer than it may be, took them all for lost, and
    # placed every replica again (tests/test_fleet_netns.py restarts the control plane).
    collect()
    with RECONCILE.time():
        reconciling.reconcile()


@shared_task(name=tasks.REPLICA_REPORT, ignore_result=True)
def replica_report(token: str, replica_id: int, state: str, endpoint: str = "", reason: str = "", seq: int = 0) -> None:
    """A node's agent saying what became of a replica it runs; arrives on the control queue."""
    state, endpoint, reason = str(state), str(endpoint or ""), str(reason or "")
    # Most reports repeat the last one: the token and the replica in one read, and done.
    if reconciling.repeated_report(enrolment.hash_token(token), int(replica_id), state, endpoint, reason):
        return
    node = enrolment.node_for_token(token)
    if node is None:
        log.warning("replica report refused: the token does not enrol a node (replica %s)", replica_id)
        return
    outcome = reconciling.record_report(node, int(replica_id), state, endpoint, reason, seq=int(seq or 0))
    log.info("replica %s on %s reported %s: %s", replica_id, node.name, state, outcome)


@shared_task(name=tasks.FETCH_FINISHED, ignore_result=True)
def fetch_finished(token: str, report: tasks.FetchReport) -> None:
    """A node's report of how a fetch ended; arrives on the control queue."""
    node = enrolment.node_for_token(token, claimed_name=report.get("node"))
    if node is None:
        log.warning("fetch report refused: the token does not enrol a node called %r", report.get("node"))
        return
    Fetch.objects.record(node, report)


@shared_task(name=demand.WAKE, ignore_result=True)
def wake(model: str) -> None:
    """A request waits for a model with no ready replica: want at least one, and place it now.

    Sent by the gateway's first waiting request (contracts/demand.py); safe to run twice:
    a model already wanted keeps its count, and the pass finds it placed.
    """
    bounds = Model.objects.filter(name=str(model)).values_list("scaling_min", "scaling_max").first()
    if bounds is None:
        log.info("wake for %r ignored: no such model in the catalog", model)
        return
    if not autoscale.wake(str(model), most=bounds[1], fewest=bounds[0]):
        log.info("wake for %s ignored: its most replicas is 0", model)
        return
    with RECONCILE.time():
        if reconciling.reconcile() is None:
            # Another pass holds the lock and may have read the count before it changed.
            reconcile.apply_async(queue=tasks.CONTROL_QUEUE, countdown=0.2)
