"""What an agent says about a replica, as the control plane takes it: signature, node, state."""

import json

import pytest
from django.utils import timezone

from fleet.enrolment import issue_token
from fleet.models import Node, Replica
from fleet.tasks import replica_report

from .support import node_messages as node

pytestmark = pytest.mark.django_db(transaction=True)


def queued(broker, queue: str) -> list[tuple[str, list]]:
    messages = [json.loads(m) for m in broker.lrange(queue, 0, -1)]
    return [(m["headers"]["task"], json.loads(__import__("base64").b64decode(m["body"]))[0]) for m in messages]


@pytest.fixture
def nodes():
    tokens = {name: issue_token(name) for name in ("a", "b")}
    Node.objects.update(last_heartbeat=timezone.now(), engines=["llamacpp"], memory_gb=32)
    return tokens


def a_replica(node_name: str = "a", state: str = Replica.State.PENDING) -> Replica:
    return Replica.objects.create(
        model_name="tiny", profile_name="cpu", node=Node.objects.get(name=node_name), state=state
    )


def test_ready_with_the_endpoint_is_recorded(nodes, broker):
    replica = a_replica()
    replica_report(node.report("a", replica.pk, "ready", "http://127.0.0.1:9000/v1", ""))
    replica.refresh_from_db()
    assert replica.state == "ready"
    assert replica.endpoint == "http://127.0.0.1:9000/v1"


def test_a_failure_keeps_its_sentence_and_counts(nodes, broker):
    replica = a_replica()
    replica_report(node.report("a", replica.pk, "failed", "", "the engine exited with code 1: out of memory"))
    replica.refresh_from_db()
    assert (replica.state, replica.reason, replica.attempts) == (
        "failed",
        "the engine exited with code 1: out of memory",
        1,
    )


def test_another_node_cannot_report_for_this_one(nodes, broker):
    replica = a_replica("a")
    replica_report(node.report("b", replica.pk, "ready", "http://127.0.0.1:9000/v1", ""))
    replica.refresh_from_db()
    assert replica.state == "pending" and replica.endpoint == ""
    # And b is told to stop whatever it runs under that id.
    assert queued(broker, "node.b") == [("agent.stop_replica", [replica.pk])]


def test_a_report_signed_with_another_key_changes_nothing(nodes, broker):
    replica = a_replica()
    replica_report(node.report("a", replica.pk, "ready", "http://127.0.0.1:9000/v1", "", token="llmgw-node-forged"))
    replica.refresh_from_db()
    assert replica.state == "pending"
    assert broker.keys("node.*") == []


def test_a_late_ready_does_not_undo_a_stop_and_stopped_deletes_the_row(nodes, broker):
    replica = a_replica(state=Replica.State.STOPPING)
    replica_report(node.report("a", replica.pk, "ready", "http://127.0.0.1:9000/v1", ""))
    assert Replica.objects.get(pk=replica.pk).state == "stopping"
    replica_report(node.report("a", replica.pk, "stopped", "", ""))
    assert not Replica.objects.filter(pk=replica.pk).exists()


def test_an_engine_reported_for_a_deleted_replica_is_told_to_stop(nodes, broker):
    replica_report(node.report("a", 9999, "ready", "http://127.0.0.1:9000/v1", ""))
    assert queued(broker, "node.a") == [("agent.stop_replica", [9999])]
