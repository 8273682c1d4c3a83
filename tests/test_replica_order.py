"""Issue 13, item 4: reports applied in their order, a lost start sent again, an extra replica stopped."""

from __future__ import annotations

import base64
import json
from datetime import timedelta
from types import SimpleNamespace

import pytest
from django.utils import timezone

from agent import engine_state, replica_reports, runtime, supervisor
from agent import tasks as agent_tasks
from contracts import keys, signing, tasks
from fleet import reconcile
from fleet.enrolment import issue_token
from fleet.models import Node, Replica
from fleet.placement import ModelView, ProfileView
from fleet.tasks import heartbeat, replica_report

from .support import node_messages as node

pytestmark = pytest.mark.django_db(transaction=True)

TINY = [ModelView("tiny", "http://127.0.0.1:8001/tiny/v1/", 1, (ProfileView("cpu", "llamacpp", min_memory_gb=1),))]


@pytest.fixture
def token():
    token = issue_token("a")
    Node.objects.filter(name="a").update(last_heartbeat=timezone.now(), engines=["llamacpp"], memory_gb=8)
    return token


def tasks_on(broker, queue: str) -> list[tuple[str, list]]:
    out = []
    while (raw := broker.rpop(queue)) is not None:
        message = json.loads(raw)
        out.append((message["headers"]["task"], json.loads(base64.b64decode(message["body"]))[0]))
    return out


def beat(token: str, replicas: list[int]) -> None:
    heartbeat(node.heartbeat("a", {"engines": ["llamacpp"], "memory_gb": 8, "replicas": replicas}))


def test_a_report_older_than_one_already_applied_is_ignored(broker, token):
    replica = Replica.objects.create(model_name="tiny", profile_name="cpu", node=Node.objects.get(name="a"))
    # The `starting` the node signed before its `ready`, delivered after it.
    starting = node.report("a", replica.pk, "starting", "", "")
    replica_report(node.report("a", replica.pk, "ready", "http://127.0.0.1:9000/v1", ""))
    replica_report(starting)
    replica.refresh_from_db()
    assert (replica.state, replica.endpoint) == ("ready", "http://127.0.0.1:9000/v1")
    replica_report(node.report("a", replica.pk, "failed", "", "the engine exited"))
    replica.refresh_from_db()
    assert replica.state == "failed"


def test_a_start_that_was_lost_is_sent_again_when_the_node_does_not_run_it(broker, token):
    reconcile.reconcile(models=TINY)
    replica = Replica.objects.get()
    assert [t for t, _ in tasks_on(broker, "node.a")] == ["agent.start_replica"]  # and lost: nobody took it
    beat(token, [])
    reconcile.reconcile(models=TINY)
    assert tasks_on(broker, "node.a") == []  # not yet: a start may take a while to be answered
    Replica.objects.filter(pk=replica.pk).update(since=timezone.now() - timedelta(seconds=61))
    reconcile.reconcile(models=TINY)
    # The source is not on this mirror: no header bounds the prompt cache, so it is off (catalog.memory).
    again = [replica.pk, replica.source, "llamacpp", ["--cache-ram", "0"]]
    assert tasks_on(broker, "node.a") == [("agent.start_replica", again)]


def test_a_pending_replica_the_node_says_it_runs_is_not_started_twice(broker, token):
    reconcile.reconcile(models=TINY)
    replica = Replica.objects.get()
    tasks_on(broker, "node.a")
    beat(token, [replica.pk])
    Replica.objects.filter(pk=replica.pk).update(since=timezone.now() - timedelta(seconds=61))
    reconcile.reconcile(models=TINY)
    assert tasks_on(broker, "node.a") == []


def test_a_replica_a_node_runs_that_is_not_placed_there_is_told_to_stop_once_a_while(broker, token):
    beat(token, [9999])
    reconcile.reconcile(models=[])
    assert tasks_on(broker, "node.a") == [("agent.stop_replica", [9999])]
    reconcile.reconcile(models=[])
    assert tasks_on(broker, "node.a") == []


def test_the_agent_numbers_and_signs_its_reports_and_heartbeats_what_it_runs(broker, tmp_path, monkeypatch):
    sent = []
    fake_app = SimpleNamespace(send_task=lambda name, args=None, kwargs=None, **o: sent.append((name, args, kwargs)))
    monkeypatch.setattr(replica_reports, "current_app", fake_app)
    monkeypatch.setattr(agent_tasks, "current_app", fake_app)
    monkeypatch.setenv(runtime.NODE_NAME, "a")
    monkeypatch.setenv(runtime.AGENT_CACHE, str(tmp_path))
    monkeypatch.setenv(runtime.NODE_TOKEN, "tok")
    report = supervisor.celery_report(runtime.key())
    report(7, "starting", "", "")
    report(7, "ready", "http://x/v1", "")
    messages = [args[0] for _, args, _ in sent]
    assert messages[0]["seq"] < messages[1]["seq"]
    assert all(not signing.message_problem(runtime.key(), tasks.REPLICA_REPORT, "a", m) for m in messages)
    assert "tok" not in json.dumps(sent)

    engine_state.want(tmp_path, 7, "llamacpp", "http://m/t/v1/", tmp_path, [], "t")
    engine_state.want(tmp_path, 8, "llamacpp", "http://m/t/v1/", tmp_path, [], "t")
    engine_state.unwant(tmp_path, 8)
    broker.delete(keys.heartbeat_key("a"), tasks.COLLECT_PENDING_KEY)
    agent_tasks.send_heartbeat({"engines": [], "gpus": []})
    assert json.loads(broker.get(keys.heartbeat_key("a")))["body"]["replicas"] == [7]
    assert sent[-1][0] == "fleet.collect"
