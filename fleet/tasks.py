"""The control plane's tasks for the fleet: what nodes report, and the reconcile pass."""

import logging

from celery import shared_task
from django.db import InterfaceError, OperationalError

from catalog.models import Model
from contracts import demand, tasks

from . import autoscale, enrolment, messages
from . import memory as measured_memory
from . import reconcile as reconciling
from .live import redis_client
from .metrics import RECONCILE
from .models import Fetch
from .reports import endpoint_problem

log = logging.getLogger(__name__)

DATABASE_AWAY = (OperationalError, InterfaceError)
# A message sent as a task of its own, retried while the database is away (a few minutes,
# as long as its signature is good) rather than dropped.
_WHILE_DATABASE_AWAY = {
    "autoretry_for": DATABASE_AWAY,
    "retry_backoff": True,
    "retry_backoff_max": 60,
    "max_retries": 8,
}


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


@shared_task(name=tasks.COLLECT, ignore_result=True)
def collect() -> None:
    """Every heartbeat and repeated report the enrolled nodes posted since the last collection, in one task.

    See contracts/tasks.py: a Celery message each would cost the control worker a third
    of a core at a thousand nodes. Each entry is checked as its own message would be, and
    one that is not believed is dropped with a line in the log: never the rest of the batch.
    With the database away, what was taken and not applied goes back to Redis for the next
    pass (the reconcile beat's): taken and dropped, a minute's outage lost every heartbeat
    and report posted in it, and the nodes were judged silent after.
    """
    try:
        _collect()
    except DATABASE_AWAY as away:
        log.warning("collecting waits for the database (%s); what the nodes posted stays in Redis", _first_line(away))


def _collect() -> None:
    nodes = enrolment.enrolled()
    heartbeats, reports, old = tasks.take(redis_client(), list(nodes))
    try:
        # Each entry leaves its dict once applied (or refused): what is left is given back.
        for name in list(heartbeats):
            _believe(nodes[name], tasks.HEARTBEAT, heartbeats[name])
            del heartbeats[name]
        for name in list(reports):
            posted = reports[name]
            for replica_id in list(posted):
                _believe(nodes[name], tasks.REPLICA_REPORT, posted[replica_id])
                del posted[replica_id]
            del reports[name]
    except DATABASE_AWAY:
        tasks.give_back(redis_client(), heartbeats, reports)
        raise
    for key, entries in old.items():
        for field in entries:
            log.warning(
                "%s entry %r dropped: it is in the old form, the node's raw token first; upgrade that node's agent",
                key,
                field[:100],
            )


@shared_task(name=tasks.HEARTBEAT, ignore_result=True, **_WHILE_DATABASE_AWAY)
def heartbeat(message, *older) -> None:
    """A node's signed heartbeat as a message of its own; most are posted and collected instead."""
    _believe(_sender(message), tasks.HEARTBEAT, message, older)


@shared_task(name=tasks.RECONCILE, ignore_result=True)
def reconcile() -> None:
    """Keep every catalog model at its replica count; on a beat and after each catalog change."""
    # What nodes posted since the last collection, first. While the control worker was
    # down their heartbeats waited in Redis; a pass that judged by the database alone
    # found every node silent for longer than it may be, took them all for lost, and
    # placed every replica again (tests/test_fleet_netns.py restarts the control plane).
    try:
        collect()
    except Exception:
        # Redis away, say: the pass still runs, or nothing is placed until it is back.
        log.exception("collecting what the nodes posted failed; reconciling with what the database holds")
    try:
        with RECONCILE.time():
            reconciling.reconcile()
    except DATABASE_AWAY as away:
        # Not a fault of this code: the beat's next pass does the work once the database is back.
        log.warning("reconcile waits for the database (%s); the next pass runs on the beat", _first_line(away))


@shared_task(name=tasks.REPLICA_REPORT, ignore_result=True, **_WHILE_DATABASE_AWAY)
def replica_report(message, *older, **older_kwargs) -> None:
    """A node's signed report of what became of a replica it runs; arrives on the control queue."""
    _believe(_sender(message), tasks.REPLICA_REPORT, message, older)


@shared_task(name=tasks.FETCH_FINISHED, ignore_result=True, **_WHILE_DATABASE_AWAY)
def fetch_finished(message, *older) -> None:
    """A node's signed report of how a fetch ended; arrives on the control queue."""
    _believe(_sender(message), tasks.FETCH_FINISHED, message, older)


# What each kind of message is called in the log.
_SAID = {tasks.HEARTBEAT: "heartbeat", tasks.REPLICA_REPORT: "replica report", tasks.FETCH_FINISHED: "fetch report"}


def _sender(message) -> enrolment.Enrolled | None:
    """The enrolled node a task's message names, or None; the signature is checked after."""
    return enrolment.enrolled_node(message.get("node")) if isinstance(message, dict) else None


def _believe(node: enrolment.Enrolled | None, kind: str, message, older: tuple = ()) -> None:
    """Apply one message a node sent or posted, if its signature and every field hold; else one log line why."""
    said = _SAID[kind]
    if older or isinstance(message, str) and not message.lstrip().startswith(("{", "[")):
        # A task of an agent before issue 33: (token, ...). The token is not logged.
        log.warning("%s refused: it is in the old form, the node's raw token first; upgrade the node's agent", said)
        return
    who = node.name if node else _claimed(message)
    try:
        seq, body = messages.opened(node, kind, message)
        if kind == tasks.HEARTBEAT:
            _heartbeat(node, body)
        elif kind == tasks.REPLICA_REPORT:
            _report(node, seq, body)
        else:
            Fetch.objects.record(node.as_node(), messages.checked_fetch(node.name, body))
    except messages.Refused as refused:
        log.warning("%s of node %s refused: %s", said, who, refused)
    except DATABASE_AWAY:
        raise  # not this message's fault: kept for when the database is back
    except Exception:
        # A fault of this code, not of the message: the rest of the batch is still applied.
        log.exception("%s of node %s could not be applied", said, who)


def _claimed(message) -> str:
    """The node a message says it is from, for the log: whoever forged it wrote it, so cut short."""
    name = message.get("node") if isinstance(message, dict) else None
    return repr(name)[:60] if name is not None else "(unnamed)"


def _heartbeat(node: enrolment.Enrolled, body: dict) -> None:
    facts = messages.checked_facts(node.name, body)
    if enrolment.record_heartbeat(node.name, facts) is None:
        return  # deleted meanwhile
    if "replicas" in facts:
        reconciling.record_running(node.name, facts["replicas"])
    # What each replica's engine really holds (fleet/memory.py).
    measured_memory.record(node.name, facts)


def _report(node: enrolment.Enrolled, seq: int, body: dict) -> None:
    report = messages.checked_report(body)
    replica_id, state, endpoint, reason = report["replica"], report["state"], report["endpoint"], report["reason"]
    # Most reports repeat the last one: the replica in one read, and done. A ready one only
    # when its endpoint is one the node may have (record_report says why not, otherwise).
    allowed = state != "ready" or endpoint_problem(node.as_node(), endpoint) is None
    if allowed and reconciling.repeated_report(node.id, replica_id, state, endpoint, reason):
        return
    outcome = reconciling.record_report(
        node.as_node(), replica_id, state, endpoint, reason, seq=seq, role=report.get("role", "")
    )
    log.info("replica %s on %s reported %s: %s", replica_id, node.name, state, outcome)


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
