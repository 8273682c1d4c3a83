"""Every figure a page shows is in the API: the pages are drawn for a replica with known figures, their numbers
read off the HTML, and each found in the API's answers (issue 36, "API parity")."""

from __future__ import annotations

import re
import time
from html import unescape
from html.parser import HTMLParser

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient

from accounts import tokens
from catalog.memory import GB, MB
from contracts import engine_stats as engine_contract
from fleet import memory
from fleet.enrolment import issue_token
from fleet.models import Node, Replica
from gateway.metrics import HOUR_PREFIX

pytestmark = pytest.mark.django_db

RSS, PSS = 300 * MB, 250 * MB
ENGINE = {"slots": 4, "slots_busy": 3, "requests_deferred": 1, "kv_cache_used": 0.42, "tokens_per_second": 55.5}


class Rows(HTMLParser):
    """Each `<tr data-model=…>`'s cells as text, with the class of each cell: enough to read a table as staff do."""

    def __init__(self):
        super().__init__()
        self.rows: list[tuple[str, list[tuple[str, str]]]] = []
        self._cell: list[str] | None = None
        self._class = ""
        self._in_row = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "tr":
            self._in_row = "data-model" in attrs
            if self._in_row:
                self.rows.append((attrs["data-model"], []))
        elif tag in ("td", "th") and self._in_row:
            self._cell, self._class = [], attrs.get("class") or ""

    def handle_endtag(self, tag):
        if tag == "tr":
            self._in_row = False
        elif tag in ("td", "th") and self._cell is not None:
            self.rows[-1][1].append((self._class, " ".join("".join(self._cell).split())))
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def rows_of(html: str, model: str) -> list[list[tuple[str, str]]]:
    parser = Rows()
    parser.feed(html)
    return [cells for name, cells in parser.rows if name == model]


def text_of(html: str) -> str:
    return " ".join(unescape(re.sub(r"<[^>]+>", " ", html)).split())


def as_page_shows(size: int) -> tuple[float, str]:
    """A size in bytes as the pages write it (GB from a gigabyte, else MB), as (number, unit)."""
    return (round(size / GB, 1), "GB") if size >= GB else (round(size / MB), "MB")


@pytest.fixture
def running_replica(redis_client):
    """A ready replica of `smol` on n1 with known figures, posted where the nodes post them."""
    issue_token("n1")
    node = Node.objects.get(name="n1")
    node.memory_gb, node.last_heartbeat = 8, timezone.now()
    node.save()
    replica = Replica.objects.create(
        model_name="smol", profile_name="cpu", node=node, state="ready", memory_gb=2, engine="llamacpp"
    )
    # Measured memory, as a heartbeat's facts are kept (the node's latest, and the profile's highest).
    memory.record("n1", {"replica_memory": {str(replica.pk): {"rss": RSS, "pss": PSS, "gpu": 0}}})
    # The engine's own figures, signed by the node as its supervisor posts them.
    stats = {**ENGINE, "at": time.time()}
    redis_client.hset(
        engine_contract.stats_key("n1"),
        str(replica.pk),
        engine_contract.encode("n1", node.token_hash, replica.pk, stats),
    )
    # The gateway's hourly counts: 80 prompt tokens, 20 of them from the engines' cache.
    hour = time.strftime("%Y%m%d%H", time.gmtime())
    redis_client.hset(
        HOUR_PREFIX + hour, mapping={"smol\trequests": 2, "smol\tprompt": 80, "smol\tcached": 20, "smol\tcompletion": 9}
    )
    return replica


@pytest.fixture
def root():
    return User.objects.create_superuser("root", password="a long password")


@pytest.fixture
def pages(root) -> Client:
    client = Client()
    client.force_login(root)
    return client


@pytest.fixture
def root_api_client(root) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Token " + tokens.issue(root))
    return client


def test_the_replicas_page_figures_are_each_in_the_replicas_api(running_replica, pages, root_api_client):
    html = pages.get("/admin/fleet/replica/").content.decode()
    words = text_of(html)
    busy, slots, deferred, kv, tps = re.search(
        r"(\d+) of (\d+) slots busy, (\d+) deferred, KV cache (\d+)%, ([\d.]+) tokens/s", words
    ).groups()
    measured = dict(re.findall(r"(RSS|PSS|GPU) ([\d.]+ [MG]B)", words))
    assert set(measured) == {"RSS", "PSS"}, words

    [row] = root_api_client.get("/api/fleet/replicas/?model=smol").json()["results"]
    load = row["engine_load"]
    assert (load["slots_busy"], load["slots"], load["requests_deferred"]) == (int(busy), int(slots), int(deferred))
    assert round(100 * load["kv_cache_used"]) == int(kv) and load["tokens_per_second"] == float(tps)
    shown = row["memory_measured"]
    for label, field in (("RSS", "rss_bytes"), ("PSS", "pss_bytes")):
        number, unit = measured[label].split()
        assert as_page_shows(shown[field]) == (float(number), unit), (label, shown)
    assert shown["host_bytes"] == PSS and shown["gpu_bytes"] == 0
    # The page's "asked" is the replica's booking; no mirror headers here, so no estimate on either.
    assert row["memory_gb"] == 2 and row["memory_estimate"] is None
    assert root_api_client.get(f"/api/fleet/replicas/{running_replica.pk}/").json()["engine_load"] == load


def test_the_overview_and_the_measured_memory_page_figures_are_each_in_the_api(running_replica, pages, root_api_client):
    html = pages.get("/admin/").content.decode()
    [engines] = [cells for cells in rows_of(html, "smol") if any(cls == "busy" for cls, _ in cells)]
    [prompt_cache] = [cells for cells in rows_of(html, "smol") if any(cls == "hit-rate" for cls, _ in cells)]
    placed = re.search(r'data-node="n1".*?(\d+)(?: GB)? of (\d+) GB', html, re.S).groups()

    fleet = root_api_client.get("/api/fleet/overview/").json()
    [engine_row] = [r for r in fleet["engines"] if r["model"] == "smol"]
    _, busy, deferred, kv, tps = (text for _, text in engines)
    assert f"{engine_row['busy']} of {engine_row['slots']}" == busy
    assert (str(engine_row["deferred"]), f"{engine_row['kv_percent']}%", str(engine_row["tokens_per_second"])) == (
        deferred,
        kv,
        tps,
    )
    [bar] = [b for b in fleet["nodes"]["bars"] if b["name"] == "n1"]
    assert (str(bar["placed"]), str(bar["total"])) == placed == ("2", "8")

    [cache_row] = root_api_client.get("/api/gateway/prompt-cache/").json()["models"]
    _, prompt, cached, rate = (text for _, text in prompt_cache)
    assert (str(cache_row["prompt"]), str(cache_row["cached"]), f"{cache_row['percent']}%") == (prompt, cached, rate)
    assert rate == "25%"

    measured_page = text_of(pages.get("/admin/fleet/measuredmemory/").content.decode())
    [peak] = root_api_client.get("/api/fleet/measured-memory/?model=smol").json()["results"]
    number, unit = as_page_shows(peak["host_bytes"])
    assert f"{number:g} {unit}" in measured_page and peak["host_bytes"] == PSS
    assert (peak["profile"], peak["node"], peak["replica"]) == ("cpu", "n1", running_replica.pk)


def test_the_new_figures_are_for_staff_who_may_read_them():
    stranger = User.objects.create_user("sam", is_staff=True)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Token " + tokens.issue(stranger))
    for url in ("/api/fleet/overview/", "/api/gateway/prompt-cache/", "/api/fleet/measured-memory/"):
        answer = client.get(url)
        assert answer.status_code == 403 and "permission" in answer.json()["detail"], url
