"""The overview and the replicas list read at a glance in a real browser, at 1400×1000 and at 1024×768.

Issue 36 found "slots busy" broken one letter per line, "0 GB of 24 GB placed" beside a
replica of 0.3 GB, and the replicas list running off the page's right edge.
"""

from __future__ import annotations

import json
import time

import pytest
from django.utils import timezone

from contracts import engine_stats as contract
from contracts import signing
from fleet import memory
from fleet.enrolment import issue_token
from fleet.models import Node, Replica
from gateway.metrics import HOUR_PREFIX

from .staff_browser import log_in_as_staff

pytestmark = [pytest.mark.django_db(transaction=True)]

SIZES = [(1400, 1000), (1024, 768)]
MODEL = "smollm2-135m-instruct-with-a-long-name-q4_1"

# The lines each heading's text is laid out on, and anything wider than the window.
MEASURE = """() => {
  const headings = [...document.querySelectorAll('#content th')].filter(th => th.innerText.trim()).map(th => {
    const tops = new Set();
    const walker = document.createTreeWalker(th, NodeFilter.SHOW_TEXT);
    while (walker.nextNode()) {
      if (!walker.currentNode.textContent.trim()) continue;
      const range = document.createRange();
      range.selectNodeContents(walker.currentNode);
      for (const r of range.getClientRects()) if (r.width > 0) tops.add(Math.round(r.top));
    }
    return {text: th.innerText.trim(), lines: tops.size};
  });
  return {headings, scrollWidth: document.scrollingElement.scrollWidth, innerWidth: window.innerWidth};
}"""


@pytest.fixture
def one_replica_running(redis_client):
    token = issue_token("gpu-node-1")
    node = Node.objects.get(name="gpu-node-1")
    node.memory_gb, node.last_heartbeat = 24, timezone.now()
    node.save()
    replica = Replica.objects.create(
        model_name=MODEL, profile_name="cpu", node=node, state="ready", memory_gb=0, endpoint="http://127.0.0.1:1/v1"
    )
    # Its node measured its engine at 0.3 GB (what fleet.memory keeps of a checked heartbeat): placement books
    # whole GB, so the bar says it beside what is placed.
    redis_client.set(
        memory.MEMORY_PREFIX + node.name,
        json.dumps({"at": time.time(), "replicas": {str(replica.pk): {"rss": int(0.3 * 1024**3), "pss": None}}}),
    )
    stats = {"slots": 4, "slots_busy": 1, "requests_deferred": 0, "kv_cache_used": 0.12, "tokens_per_second": 41.5}
    redis_client.hset(
        contract.stats_key(node.name),
        str(replica.pk),
        contract.encode(node.name, signing.token_hash(token), replica.pk, {**stats, "at": time.time()}),
    )
    hour = time.strftime("%Y%m%d%H", time.gmtime())
    redis_client.hset(
        HOUR_PREFIX + hour,
        mapping={f"{MODEL}\trequests": 3, f"{MODEL}\tprompt": 900, f"{MODEL}\tcached": 300, f"{MODEL}\tcompletion": 60},
    )
    return replica


def measure(page, path, name, width, height, tmp_path) -> dict:
    page.set_viewport_size({"width": width, "height": height})
    page.goto(page.url.split("/admin/")[0] + path)
    page.screenshot(path=str(tmp_path / f"{name}-{width}x{height}.png"), full_page=True)
    return page.evaluate(MEASURE)


@pytest.mark.browser
def test_the_overview_and_replicas_list_keep_headings_on_their_words_and_fit_the_window(
    live_server, one_replica_running, tmp_path
):
    from .staff_browser import chromium_page

    with chromium_page() as page:
        log_in_as_staff(page, live_server)
        for width, height in SIZES:
            for path, name in (("/admin/", "overview"), ("/admin/fleet/replica/", "replicas")):
                found = measure(page, path, name, width, height, tmp_path)
                assert found["headings"], f"{name} at {width}×{height} has no table headings"
                tall = [h for h in found["headings"] if h["lines"] > 2]
                assert tall == [], f"{name} at {width}×{height}: headings over two lines: {tall}"
                assert found["scrollWidth"] <= found["innerWidth"], (
                    f"{name} at {width}×{height} runs {found['scrollWidth'] - found['innerWidth']} px off the right"
                )
            if (width, height) == SIZES[0]:
                overview = page.goto(live_server.url + "/admin/") and page
                assert page.inner_text("#overview-engines th:has-text('slots busy')").lower() == "slots busy"
                assert "1 of 4" in page.inner_text(f"#overview-engines [data-model='{MODEL}']")
                assert "of 24 GB, 307 MB in use" in overview.inner_text("[data-node=gpu-node-1]")
        assert sorted(p.name for p in tmp_path.glob("*.png")) == sorted(
            f"{n}-{w}x{h}.png" for n in ("overview", "replicas") for w, h in SIZES
        )


@pytest.mark.parametrize(
    ("placed", "total", "said"),
    [(0.3, 24, "307 MB of 24 GB"), (0, 24, "0 of 24 GB"), (60, 80, "60 of 80 GB"), (1.5, 24, "1.5 of 24 GB")],
)
def test_memory_placed_under_a_gigabyte_reads_in_megabytes(placed, total, said):
    from django.template import Context, Template

    assert Template("{% load sizes %}{% placed_of placed total %}").render(Context(locals())) == said


def test_the_overview_api_gives_each_nodes_memory_in_use_as_the_page_does(one_replica_running, staff_client):
    bar = staff_client.get("/api/fleet/overview/").json()["nodes"]["bars"][0]
    assert (bar["name"], bar["placed"], bar["in_use"]) == ("gpu-node-1", 0, int(0.3 * 1024**3))
