"""The overview in a real browser: charts drawn from static files, memory bars, a fetch's progress moving live."""

from __future__ import annotations

import json
import time

import pytest
from django.utils import timezone

from contracts import progress
from fleet.models import Node, Replica
from gateway.keys import create_key
from gateway.metrics import HOUR_PREFIX
from gateway.models import Usage

from .staff_browser import chromium_page, log_in_as_staff, screenshot

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

SOURCE = "http://127.0.0.1:8001/llama/v1/"


def publish(redis_client, percent: int) -> None:
    snapshot = {
        "state": "fetching",
        "bytes_done": percent * 10_000_000,
        "bytes_total": 1_000_000_000,
        "rate": 52_428_800,
        "updated": time.time(),
    }
    redis_client.hset(progress.progress_key("gpu-2"), SOURCE, json.dumps(snapshot))
    redis_client.zadd(progress.progress_sources_key("gpu-2"), {SOURCE: time.time()})


def test_the_front_page_draws_the_fleet_and_its_usage_and_follows_a_fetch(live_server, redis_client):
    now = timezone.now()
    gpu1 = Node.objects.create(name="gpu-1", memory_gb=80, last_heartbeat=now)
    gpu2 = Node.objects.create(name="gpu-2", memory_gb=80, last_heartbeat=now)
    Node.objects.create(name="cpu-1", memory_gb=32)
    Replica.objects.create(model_name="llama", profile_name="p", node=gpu1, state="ready", memory_gb=60)
    Replica.objects.create(model_name="qwen", profile_name="p", node=gpu2, state="fetching", memory_gb=20)
    key, _ = create_key("team-a")
    today = timezone.localdate()
    for days_ago in range(30):
        for model, scale in (("llama", 3), ("qwen", 1)):
            Usage.objects.create(
                key=key,
                model_name=model,
                day=today - timezone.timedelta(days=days_ago),
                requests=scale * (10 + days_ago % 7),
                prompt_tokens=scale * 900,
                completion_tokens=scale * 300,
            )
    # Only this test's hours: a gateway an earlier test in this worker started may have written its
    # hourly counts as it stopped, after that test's keys were deleted (CI, 2026-12-04: a "smollm2-135m" series).
    for leftover in redis_client.scan_iter(HOUR_PREFIX + "*"):
        redis_client.delete(leftover)
    for hours_ago in range(24):
        hour = time.strftime("%Y%m%d%H", time.gmtime(time.time() - hours_ago * 3600))
        redis_client.hset(
            HOUR_PREFIX + hour,
            mapping={"llama\trequests": 5 + hours_ago % 4, "llama\tprompt": 400, "llama\tcompletion": 90},
        )
    publish(redis_client, 25)

    with chromium_page() as page:
        errors = []
        page.on("pageerror", lambda error: errors.append(str(error)))
        log_in_as_staff(page, live_server)
        assert page.inner_text("[data-count=ready]") == "2"
        assert page.inner_text("[data-count=not_ready]") == "1"
        assert "60 of 80 GB" in page.inner_text("[data-node=gpu-1]")
        assert page.inner_text("#overview-replicas [data-state=ready] td") == "1"
        # Chart.js came from the admin server's own static files, and drew four charts.
        assert page.evaluate("typeof Chart") == "function"
        charts = page.evaluate(
            "['chart-requests-day','chart-tokens-day','chart-requests-month','chart-tokens-month']"
            ".map(id => Chart.getChart(document.getElementById(id)).data.datasets.map(d => d.label))"
        )
        assert charts == [["llama"], ["llama"], ["llama", "qwen"], ["llama", "qwen"]]
        assert page.evaluate("document.getElementById('chart-requests-month').height") > 100
        assert page.get_attribute(f"[data-source='{SOURCE}']", "data-percent") == "25.0"
        publish(redis_client, 75)
        page.wait_for_selector(f"[data-source='{SOURCE}'][data-percent='75.0']", timeout=5000)
        screenshot(page, "overview")
        assert errors == []
