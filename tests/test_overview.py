"""The admin's front page: the fleet at a glance, in a fixed handful of queries at any size."""

from __future__ import annotations

import json
import time

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from contracts import progress
from fleet.models import Node, Replica
from gateway.metrics import HOUR_PREFIX

from .overview_data import build_fleet_at_scale

pytestmark = pytest.mark.django_db(transaction=True)

# Session, user, the app list's permissions, and the overview's own grouped reads.
MOST_QUERIES = 12


def test_the_front_page_reads_a_fleet_of_a_thousand_nodes_in_a_handful_of_queries(staff_client, redis_client):
    build_fleet_at_scale()
    with CaptureQueriesContext(connection) as queries:
        page = staff_client.get("/admin/")
    assert page.status_code == 200
    assert len(queries) <= MOST_QUERIES, "\n".join(q["sql"][:200] for q in queries.captured_queries)
    body = page.content.decode()
    nodes = page.context["nodes"]
    assert nodes["total"] == 1000 and nodes["ready"] + nodes["not_ready"] + nodes["draining"] == 1000
    assert len(nodes["bars"]) == 24 and nodes["bars_hidden"] == 976
    assert sum(row["count"] for row in page.context["replicas"]) == 1000
    month = page.context["usage_month"]
    assert len(month["labels"]) == 30
    # Eight models drawn and the rest together, so a chart of 500 models still says something.
    assert len(month["requests"]) == 9 and month["requests"][-1]["label"] == "other models"
    assert month["total_requests"] > 0
    assert "chart.umd.min.js" in body and "cdn" not in body.lower()


def test_the_overview_shows_memory_placed_replicas_and_the_last_24_hours(staff_client, redis_client):
    node = Node.objects.create(name="gpu-1", memory_gb=80, last_heartbeat=timezone.now())
    Replica.objects.create(model_name="llama", profile_name="p", node=node, state="ready", memory_gb=60)
    Replica.objects.create(model_name="llama", profile_name="p", state="pending")
    hour = time.strftime("%Y%m%d%H", time.gmtime())
    redis_client.hset(HOUR_PREFIX + hour, mapping={"llama\trequests": 7, "llama\tprompt": 70, "llama\tcompletion": 30})
    page = staff_client.get("/admin/")
    body = page.content.decode()
    assert page.context["nodes"]["bars"][0] == {
        "name": "gpu-1",
        "total": 80,
        "placed": 60,
        "percent": 75,
        "ready": True,
        "in_use": None,  # its node has measured nothing
    }
    assert "60 of 80 GB" in body
    states = {row["state"]: row["count"] for row in page.context["replicas"]}
    assert states["ready"] == 1 and states["pending"] == 1
    day = page.context["usage_day"]
    assert day["requests"] == [{"label": "llama", "data": [0] * 23 + [7]}]
    assert day["tokens"][0]["data"][-1] == 100
    # The apps are still there, below.
    assert "Mirror versions" in body or "Mirror" in body


def test_fetches_under_way_are_a_fragment_htmx_refreshes(staff_client, redis_client):
    Node.objects.create(name="gpu-1")  # progress is read for the enrolled nodes
    source = "http://mirror:8001/llama/v1/"
    snapshot = {"state": "fetching", "bytes_done": 250, "bytes_total": 1000, "rate": 2048, "updated": time.time()}
    redis_client.hset(progress.progress_key("gpu-1"), source, json.dumps(snapshot))
    redis_client.zadd(progress.progress_sources_key("gpu-1"), {source: time.time()})
    fragment = staff_client.get("/admin/", headers={"HX-Request": "true"})
    text = fragment.content.decode()
    assert "<html" not in text and 'data-percent="25.0"' in text and "gpu-1" in text


def test_the_front_page_is_for_staff_only():
    page = Client().get("/admin/")
    assert page.status_code == 302 and "/admin/login/" in page["Location"]
