"""Heartbeats and repeated reports posted in Redis and taken in batches, each still checked by its token."""

import json

import pytest
import redis
from django.conf import settings
from django.utils import timezone

from contracts import tasks
from fleet.enrolment import issue_token
from fleet.models import Node, Replica
from fleet.tasks import collect

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def broker():
    client = redis.Redis.from_url(settings.REDIS_URL)
    client.delete(tasks.HEARTBEATS_KEY, tasks.REPORTS_KEY, tasks.COLLECT_PENDING_KEY, tasks.CONTROL_QUEUE)
    yield client
    client.delete(tasks.HEARTBEATS_KEY, tasks.REPORTS_KEY, tasks.COLLECT_PENDING_KEY, tasks.CONTROL_QUEUE)


def queued(broker) -> list[str]:
    return [json.loads(m)["headers"]["task"] for m in broker.lrange(tasks.CONTROL_QUEUE, 0, -1)]


def test_many_posts_ask_for_one_collection_and_it_takes_them_all(broker):
    from celery import current_app

    tokens = {name: issue_token(name) for name in ("a", "b", "c")}
    for name, token in tokens.items():
        facts = {"node": name, "engines": ["llamacpp"], "memory_gb": 8}
        tasks.post(broker, current_app.send_task, tasks.HEARTBEATS_KEY, name, json.dumps([token, facts]))
    # A forged heartbeat: a token that enrols no node, and one that is not JSON.
    tasks.post(broker, current_app.send_task, tasks.HEARTBEATS_KEY, "x", json.dumps(["llmgw-node-forged", {}]))
    broker.hset(tasks.HEARTBEATS_KEY, "y", "{not json")
    assert queued(broker) == ["fleet.collect"]

    collect()
    nodes = {n.name: n for n in Node.objects.all()}
    assert sorted(nodes) == ["a", "b", "c"]
    assert all(n.last_heartbeat is not None and n.memory_gb == 8 for n in nodes.values())
    assert broker.hlen(tasks.HEARTBEATS_KEY) == 0
    # Taken: the next post asks for the next collection.
    tasks.post(broker, current_app.send_task, tasks.HEARTBEATS_KEY, "a", json.dumps([tokens["a"], {"node": "a"}]))
    assert queued(broker) == ["fleet.collect", "fleet.collect"]


def test_a_repeated_report_is_collected_and_a_lost_state_made_good(broker):
    from celery import current_app

    token = issue_token("a")
    node = Node.objects.get(name="a")
    Node.objects.filter(pk=node.pk).update(last_heartbeat=timezone.now())
    replica = Replica.objects.create(model_name="m", profile_name="cpu", node=node, state="starting")
    entry = json.dumps([token, replica.pk, "ready", "http://127.0.0.1:9/v1", "", 5])
    tasks.post(broker, current_app.send_task, tasks.REPORTS_KEY, str(replica.pk), entry)
    forged = json.dumps(["llmgw-node-forged", replica.pk, "failed", "", "forged", 6])
    broker.hset(tasks.REPORTS_KEY, "other", forged)
    collect()
    replica.refresh_from_db()
    assert (replica.state, replica.endpoint) == ("ready", "http://127.0.0.1:9/v1")
