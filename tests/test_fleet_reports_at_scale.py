"""Heartbeats and replica reports at fleet size: a report that repeats the last one writes nothing."""

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from fleet import reports
from fleet.enrolment import issue_token
from fleet.models import Node, Replica
from fleet.tasks import heartbeat, replica_report

from .support import node_messages as as_node
from .support.queries import writes

pytestmark = pytest.mark.django_db

FACTS = {
    "node": "a",
    "engines": ["llamacpp"],
    "gpus": [],
    "memory_gb": 32,
    "disk_free_bytes": 10**12,
    "agent_version": "0.1.0",
    "labels": {"zone": "eu"},
}


@pytest.fixture
def token() -> str:
    return issue_token("a", address="10.0.0.1")


def test_a_heartbeat_writes_its_time_and_only_the_facts_that_changed(token):
    heartbeat(as_node.heartbeat("a", FACTS))
    Node.objects.update(last_heartbeat=timezone.now() - timedelta(minutes=5))
    beat = as_node.heartbeat("a", FACTS)
    with CaptureQueriesContext(connection) as queries:
        heartbeat(beat)
    [update] = writes(queries)
    assert "last_heartbeat" in update and "engines" not in update and "disk_free_bytes" not in update
    node = Node.objects.get()
    assert node.state == Node.State.READY

    with CaptureQueriesContext(connection) as queries:
        heartbeat(as_node.heartbeat("a", dict(FACTS, disk_free_bytes=5, labels={"zone": "us"})))
    [update] = writes(queries)
    assert "disk_free_bytes" in update and "labels" in update and "engines" not in update
    node.refresh_from_db()
    assert (node.disk_free_bytes, node.labels, node.engines, node.memory_gb) == (5, {"zone": "us"}, ["llamacpp"], 32)


def test_a_heartbeat_for_another_node_or_with_a_wrong_key_writes_nothing(token):
    issue_token("b")
    before = list(Node.objects.values_list("name", "last_heartbeat", "memory_gb"))
    with CaptureQueriesContext(connection) as queries:
        # a's signature on a message naming b; facts that say b in a's message; another token's key.
        heartbeat(dict(as_node.heartbeat("a", dict(FACTS, memory_gb=1)), node="b"))
        heartbeat(as_node.heartbeat("a", dict(FACTS, node="b", memory_gb=1)))
        heartbeat(as_node.heartbeat("a", FACTS, token="llmgw-node-wrong"))
    assert writes(queries) == []
    assert list(Node.objects.values_list("name", "last_heartbeat", "memory_gb")) == before


def test_a_report_that_repeats_the_last_one_writes_nothing_and_a_new_one_is_recorded(token):
    replica = Replica.objects.create(model_name="m", profile_name="cpu", node=Node.objects.get(), state="starting")
    replica_report(as_node.report("a", replica.pk, "ready", "http://10.0.0.1:9000/v1", ""))
    again = as_node.report("a", replica.pk, "ready", "http://10.0.0.1:9000/v1", "")
    with CaptureQueriesContext(connection) as queries:
        replica_report(again)
    assert writes(queries) == []
    # The node by the name its message gives (a collection reads every node's at once), and the replica.
    assert len(queries) == 2

    replica_report(as_node.report("a", replica.pk, "ready", "http://10.0.0.1:9001/v1", ""))
    replica.refresh_from_db()
    assert (replica.state, replica.endpoint) == ("ready", "http://10.0.0.1:9001/v1")


def test_a_repeated_failure_still_counts_and_a_report_from_another_node_is_not_taken_as_before(
    token, django_capture_on_commit_callbacks, monkeypatch
):
    issue_token("b", address="10.0.0.2")
    replica = Replica.objects.create(model_name="m", profile_name="cpu", node=Node.objects.get(name="a"))
    replica_report(as_node.report("a", replica.pk, "failed", "", "out of memory"))
    replica_report(as_node.report("a", replica.pk, "failed", "", "out of memory"))
    replica.refresh_from_db()
    assert (replica.state, replica.attempts) == ("failed", 2)

    Replica.objects.filter(pk=replica.pk).update(state="ready", endpoint="http://10.0.0.2:1/v1", attempts=0)
    sent = []
    monkeypatch.setattr(reports, "send_stop", lambda replica_id, node: sent.append((replica_id, node)))
    with django_capture_on_commit_callbacks(execute=True):
        replica_report(as_node.report("b", replica.pk, "ready", "http://10.0.0.2:1/v1", ""))
    # Not "as before": node b does not run it, so it is told to stop its engine.
    assert sent == [(replica.pk, "b")]
