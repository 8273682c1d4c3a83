"""Heartbeats and repeated reports posted in Redis and taken in batches, each still checked by its node's signature."""

import json

import pytest
import redis
from django.conf import settings
from django.utils import timezone

from contracts import keys, tasks
from fleet.enrolment import issue_token
from fleet.models import Node, Replica
from fleet.tasks import collect

from .support import node_messages as node

pytestmark = pytest.mark.django_db(transaction=True)

NAMES = ("a", "b", "c", "x")


@pytest.fixture
def collections_broker():
    client = redis.Redis.from_url(settings.REDIS_URL)
    shared = (tasks.COLLECT_PENDING_KEY, tasks.CONTROL_QUEUE, tasks.OLD_HEARTBEATS_KEY, tasks.OLD_REPORTS_KEY)
    client.delete(*shared, *node.node_keys(client, *NAMES))
    yield client
    client.delete(*shared, *node.node_keys(client, *NAMES))


def queued(collections_broker) -> list[str]:
    return [json.loads(m)["headers"]["task"] for m in collections_broker.lrange(tasks.CONTROL_QUEUE, 0, -1)]


def test_many_posts_ask_for_one_collection_and_it_takes_them_all(collections_broker):
    for name in ("a", "b", "c"):
        issue_token(name)
        node.post_heartbeat(collections_broker, name, node.heartbeat(name, {"engines": ["llamacpp"], "memory_gb": 8}))
    issue_token("x")
    # Forged: x's heartbeat signed with a token that is not x's, and one that is not JSON.
    node.post_heartbeat(collections_broker, "x", node.heartbeat("x", {"memory_gb": 99}, token="llmgw-node-forged"))
    assert queued(collections_broker) == ["fleet.collect"]

    collect()
    nodes = {n.name: n for n in Node.objects.all()}
    assert all(nodes[n].last_heartbeat is not None and nodes[n].memory_gb == 8 for n in ("a", "b", "c"))
    assert nodes["x"].last_heartbeat is None and nodes["x"].memory_gb == 0
    assert not collections_broker.exists(*(keys.heartbeat_key(n) for n in NAMES))
    # Taken: the next post asks for the next collection.
    node.post_heartbeat(collections_broker, "a", node.heartbeat("a", {}))
    assert queued(collections_broker) == ["fleet.collect", "fleet.collect"]


def test_a_repeated_report_is_collected_and_a_lost_state_made_good(collections_broker):
    issue_token("a")
    issue_token("b")
    a = Node.objects.get(name="a")
    Node.objects.filter(pk=a.pk).update(last_heartbeat=timezone.now())
    replica = Replica.objects.create(model_name="m", profile_name="cpu", node=a, state="starting")
    node.post_report(
        collections_broker, "a", replica.pk, node.report("a", replica.pk, "ready", "http://127.0.0.1:9/v1")
    )
    # b, another node, posts a report of a's replica into its own hash; and one forged in a's.
    node.post_report(collections_broker, "b", replica.pk, node.report("b", replica.pk, "failed", reason="forged by b"))
    forged = node.report("a", replica.pk, "failed", reason="forged", token="llmgw-node-forged")
    collections_broker.hset(keys.reports_key("a"), "other", json.dumps(forged))
    collect()
    replica.refresh_from_db()
    assert (replica.state, replica.endpoint, replica.attempts) == ("ready", "http://127.0.0.1:9/v1", 0)


def test_an_entry_in_the_old_token_form_is_taken_and_refused_saying_why(collections_broker, caplog):
    token = issue_token("a")
    collections_broker.hset(tasks.OLD_HEARTBEATS_KEY, "a", json.dumps([token, {"node": "a", "memory_gb": 8}]))
    collect()
    assert Node.objects.get(name="a").last_heartbeat is None
    assert not collections_broker.exists(tasks.OLD_HEARTBEATS_KEY)
    assert "old form" in caplog.text and token not in caplog.text
