"""The fleet's, the mirror's and the reconcile pass's metrics, and who may read /metrics."""

from __future__ import annotations

import json
import time
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.test import Client, RequestFactory
from django.utils import timezone

from accounts import tokens
from contracts import progress
from fleet import tasks
from fleet.metrics import reason_kind
from fleet.models import Fetch, Node, Replica
from mirror import bytes_views

from .scrape import samples, total, value
from .support.mirror import put

pytestmark = pytest.mark.django_db(transaction=True)

TOKEN = "the-scrapers-token"


@pytest.fixture
def scraper(settings):
    settings.METRICS_TOKEN = TOKEN
    client = Client()

    def scrape() -> dict:
        answer = client.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
        assert answer.status_code == 200
        return samples(answer.content.decode())

    return scrape


def staff_token(staff: bool) -> str:
    user = get_user_model().objects.create_user("staff" if staff else "someone", is_staff=staff)
    return tokens.issue(user)


def test_only_the_metrics_token_a_staff_token_or_an_allowed_address_may_scrape(settings):
    settings.METRICS_TOKEN = TOKEN
    settings.METRICS_ALLOW = []
    client = Client()
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers={"Authorization": "Bearer not-it"}).status_code == 401
    assert client.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
    assert client.get("/metrics", headers={"Authorization": f"Token {staff_token(True)}"}).status_code == 200
    assert client.get("/metrics", headers={"Authorization": f"Bearer {staff_token(False)}"}).status_code == 401
    settings.METRICS_ALLOW = ["10.0.0.0/8"]
    assert client.get("/metrics").status_code == 401  # the test client is 127.0.0.1
    settings.METRICS_ALLOW = ["10.0.0.0/8", "127.0.0.1"]
    assert client.get("/metrics").status_code == 200


def test_nodes_are_counted_by_state_with_memory_and_gpus_as_placed(scraper):
    now = timezone.now()
    a = Node.objects.create(name="a", memory_gb=64, gpus=[{"name": "L4"}, {"name": "L4"}], last_heartbeat=now)
    Node.objects.create(name="b", memory_gb=32, last_heartbeat=now - timedelta(hours=1))
    Node.objects.create(name="c", memory_gb=16, last_heartbeat=now, draining=True)
    Replica.objects.create(model_name="m", profile_name="p", node=a, state="ready", memory_gb=20, gpus=1)
    Replica.objects.create(model_name="m", profile_name="p", node=a, state="starting", memory_gb=8)
    found = scraper()
    assert value(found, "llmgw_nodes", state="ready") == 1
    assert value(found, "llmgw_nodes", state="not_ready") == 1
    assert value(found, "llmgw_nodes", state="draining") == 1
    assert value(found, "llmgw_node_memory_gb", node="a", kind="total") == 64
    assert value(found, "llmgw_node_memory_gb", node="a", kind="used") == 28
    assert value(found, "llmgw_node_memory_gb", node="a", kind="free") == 36
    assert value(found, "llmgw_node_memory_gb", node="b", kind="free") == 32
    assert value(found, "llmgw_node_gpus", node="a", kind="used") == 1
    assert value(found, "llmgw_node_gpus", node="a", kind="free") == 1


def test_replicas_are_counted_by_model_and_state_and_unplaced_ones_by_reason(scraper):
    node = Node.objects.create(name="a", memory_gb=8, last_heartbeat=timezone.now())
    Replica.objects.create(model_name="llama", profile_name="p", node=node, state="ready")
    Replica.objects.create(model_name="llama", profile_name="p", node=node, state="ready")
    Replica.objects.create(model_name="qwen", profile_name="p", node=node, state="fetching")
    Replica.objects.create(model_name="big", profile_name="p", state="pending", reason="a: 8 GB free, needs 80")
    Replica.objects.create(model_name="big2", profile_name="p", state="pending", reason="no node has enrolled")
    found = scraper()
    assert value(found, "llmgw_replicas", model="llama", state="ready") == 2
    assert value(found, "llmgw_replicas", model="qwen", state="fetching") == 1
    assert value(found, "llmgw_replicas", model="big", state="pending") == 1
    assert value(found, "llmgw_replicas_unplaced", reason="memory") == 1
    assert value(found, "llmgw_replicas_unplaced", reason="no_nodes") == 1


@pytest.mark.parametrize(
    "reason, kind",
    [
        ("a, b: 8 GB free, needs 80", "memory"),
        ("a: 0 GPUs free, needs 1", "gpus"),
        ("a: no label zone", "labels"),
        ("a: zone is eu, needs us", "labels"),
        ("a, b and 3 more: not ready", "nodes_not_ready"),
        ("a: draining", "draining"),
        ("a: no vllm", "engine"),
        ("tiny has no profile to run it with", "no_profile"),
    ],
)
def test_a_placement_reason_is_named_by_a_few_bounded_words(reason, kind):
    assert reason_kind(reason) == kind


def test_fetches_are_counted_by_state_with_the_live_ones_throughput_and_stalls(scraper, redis_client):
    node = Node.objects.create(name="a")
    Fetch.objects.create(node=node, source="http://m/x/v1/", state="complete")
    Fetch.objects.create(node=node, source="http://m/y/v1/", state="failed")
    Fetch.objects.create(node=node, source="http://m/z/v1/", state="requested")
    now = time.time()
    for source, snapshot in {
        "http://m/z/v1/": {"state": "fetching", "rate": 5_000_000, "updated": now},
        "http://m/w/v1/": {"state": "fetching", "rate": 0, "updated": now - 600},
        "http://m/x/v1/": {"state": "complete", "rate": 0, "updated": now},
    }.items():
        redis_client.hset(progress.progress_key("a"), source, json.dumps(snapshot))
        redis_client.zadd(progress.progress_sources_key("a"), {source: now})
    found = scraper()
    assert value(found, "llmgw_fetches", state="complete") == 1
    assert value(found, "llmgw_fetches", state="failed") == 1
    assert value(found, "llmgw_fetches", state="requested") == 1
    assert value(found, "llmgw_fetches_under_way", node="a") == 2
    assert value(found, "llmgw_fetch_bytes_per_second", node="a") == 5_000_000
    assert value(found, "llmgw_fetches_stalled", node="a") == 1


def test_a_reconcile_pass_is_timed(scraper, redis_client):
    before = total(scraper(), "llmgw_reconcile_duration_seconds_count")
    tasks.reconcile()
    tasks.reconcile()
    found = scraper()
    assert total(found, "llmgw_reconcile_duration_seconds_count") == before + 2
    assert total(found, "llmgw_reconcile_duration_seconds_sum") > 0


def test_bytes_served_by_the_byte_listener_are_counted(scraper, mirror_root):
    put(mirror_root, "tiny", "v1", {"a.gguf": b"x" * 1000})
    before = scraper()
    factory = RequestFactory()
    whole = bytes_views.file(factory.get("/tiny/v1/a.gguf"), "tiny", "v1", "a.gguf")
    ranged = bytes_views.file(factory.get("/tiny/v1/a.gguf", HTTP_RANGE="bytes=100-199"), "tiny", "v1", "a.gguf")
    assert (whole.status_code, ranged.status_code) == (200, 206)
    whole.close()
    ranged.close()
    found = scraper()
    assert value(found, "llmgw_bytes_served_total") - value(before, "llmgw_bytes_served_total") == 1100
    assert (
        value(found, "llmgw_files_served_total", status="206") - value(before, "llmgw_files_served_total", status="206")
        == 1
    )
