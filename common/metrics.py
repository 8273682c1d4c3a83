"""`/metrics` on the admin port: Prometheus's text format, for scrapers that may see it.

Counters and histograms are kept where the thing happens (the gateway, the byte
listener, the reconcile task) with the official prometheus_client. Where more
than one process serves, PROMETHEUS_MULTIPROC_DIR makes them write to files that
this view adds up, so a scrape sees the whole host, not the one process that
answered it. Gauges about the fleet are not kept at all: collectors registered
here by the apps read them from the database at scrape time, so they can never
disagree with the admin.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import shutil
from pathlib import Path

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_safe
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest, multiprocess
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.registry import Collector

from accounts import tokens

from .permissions import reads_llmgw

# Collected at each scrape: what a process keeps in memory as plain numbers (the gateway's tallies).
_scrape_time = CollectorRegistry(auto_describe=False)
# The fleet's gauges, read from the database at each scrape: exported by the admin server
# alone. A gateway that exported them too showed the fleet once per gateway in every sum,
# and answered its /metrics 500 while PostgreSQL was away (issue 41).
_fleet = CollectorRegistry(auto_describe=False)


def register(collector: Collector) -> None:
    """Add a collector of this process's own numbers, read at scrape time."""
    _scrape_time.register(collector)


def register_fleet(collector: Collector) -> None:
    """Add a collector of the fleet's state, read from the database at scrape time: on the admin's /metrics only."""
    _fleet.register(collector)


def multiprocess_dir() -> str:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR", "")


def fresh_multiprocess_dir(path: Path) -> Path:
    """An empty directory for the processes about to start: files of a previous run would count twice."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def exposition(fleet: bool = True) -> bytes:
    """Everything this host counts, in Prometheus's text format; with `fleet`, the fleet's gauges too."""
    if multiprocess_dir():
        counted = CollectorRegistry()
        multiprocess.MultiProcessCollector(counted)
    else:
        counted = REGISTRY
    return generate_latest(counted) + generate_latest(_scrape_time) + (generate_latest(_fleet) if fleet else b"")


def may_scrape(request: HttpRequest) -> bool:
    """A scraper presents LLMGW_METRICS_TOKEN or a staff DRF token, or comes from an allowed address."""
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    given = given.strip()
    if scheme.lower() in ("bearer", "token") and given:
        if settings.METRICS_TOKEN and hmac.compare_digest(given.encode(), settings.METRICS_TOKEN.encode()):
            return True
        if _staff_token(given):  # as the API takes it: "Token <key>", or "Bearer <key>" as scrapers send
            return True
    if reads_llmgw(request.user):
        return True  # a signed-in staff member looking at it in a browser
    return address_allowed(request.META.get("REMOTE_ADDR", ""), settings.METRICS_ALLOW)


def _staff_token(given: str) -> bool:
    token, _ = tokens.check(given)
    return token is not None and token.user.is_staff


def address_allowed(address: str, allowed: list[str]) -> bool:
    if not address or not allowed:
        return False
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    for entry in allowed:
        try:
            if ip in ipaddress.ip_network(entry, strict=False):
                return True
        except ValueError:
            continue
    return False


@require_safe
def metrics_view(request: HttpRequest) -> HttpResponse:
    if not may_scrape(request):
        response = HttpResponse(
            "Scraping needs 'Authorization: Bearer <LLMGW_METRICS_TOKEN>' or a staff API token.\n",
            status=401,
            content_type="text/plain",
        )
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    return HttpResponse(exposition(), content_type=CONTENT_TYPE_PLAIN_0_0_4)
