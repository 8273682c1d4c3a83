"""The gateway's counts for Prometheus: plain numbers the event loop adds to, the collector that reads them at
scrape time, and the gateway's /metrics that serves them.

metrics.py's Observer does the counting, from its hooks; labels stay bounded as it says.
"""

from __future__ import annotations

import asyncio
import hmac
from bisect import bisect_left

from django.conf import settings
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from common import metrics

# Seconds: from a fast stub's sub-millisecond answer to a long generation.
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
ADDED_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)


class Tallies:
    """The gateway's counts, as plain numbers updated on the event loop; read at scrape time.

    prometheus_client's Counter and Histogram take a lock (and, in multiprocess mode,
    write to a file) on every update: ten of them a request cost more than the rest of
    the gateway's own work. Here an update is a dict lookup and an add, and only the
    event loop's thread writes; a scrape (in a Django thread) copies the dicts, which
    CPython does without letting another thread in. They are the admin server's own,
    the process that answers /metrics.
    """

    def __init__(self) -> None:
        self.requests: dict[tuple[str, str, str, str], int] = {}
        self.duration: dict[tuple[str, str], list] = {}  # (model, kind) -> [bucket counts..., sum]
        self.first_token: dict[tuple[str], list] = {}
        self.added: dict[tuple, list] = {}
        self.prompt: dict[tuple[str], int] = {}
        self.completion: dict[tuple[str], int] = {}
        self.cached: dict[tuple[str], int] = {}
        self.routed: dict[tuple[str, str], int] = {}
        self.in_flight: dict[tuple[str], int] = {}
        self.failovers: dict[tuple[str], int] = {}
        self.key_requests: dict[tuple[str, str], int] = {}
        self.key_tokens: dict[tuple[str, str], int] = {}


def add(into: dict, labels: tuple, n: int = 1) -> None:
    into[labels] = into.get(labels, 0) + n


def observe(into: dict, labels: tuple, buckets: tuple[float, ...], seconds: float) -> None:
    counts = into.get(labels)
    if counts is None:
        counts = into[labels] = [0] * (len(buckets) + 1) + [0.0]
    counts[bisect_left(buckets, seconds)] += 1  # the first bucket whose bound is >= seconds; past all: +Inf
    counts[-1] += seconds


TALLIES = Tallies()


# What the collector exports, in this order: (kind, name, help, labels, the Tallies field, a histogram's buckets).
FAMILIES = (
    (
        "counter",
        "llmgw_gateway_requests",
        "Requests the gateway answered.",
        ["model", "kind", "stream", "status"],
        "requests",
    ),
    (
        "histogram",
        "llmgw_gateway_request_duration_seconds",
        "From a request's arrival to the end of its answer.",
        ["model", "kind"],
        "duration",
        DURATION_BUCKETS,
    ),
    (
        "histogram",
        "llmgw_gateway_time_to_first_token_seconds",
        "Streamed answers: from the request's arrival to the first event passed on.",
        ["model"],
        "first_token",
        DURATION_BUCKETS,
    ),
    (
        "histogram",
        "llmgw_gateway_added_seconds",
        "The gateway's own time: from a request's arrival to sending it on to a replica.",
        [],
        "added",
        ADDED_BUCKETS,
    ),
    ("counter", "llmgw_gateway_prompt_tokens", "Prompt tokens, as the engines counted them.", ["model"], "prompt"),
    (
        "counter",
        "llmgw_gateway_completion_tokens",
        "Completion tokens, as the engines counted them.",
        ["model"],
        "completion",
    ),
    (
        "counter",
        "llmgw_gateway_cached_prompt_tokens",
        "Prompt tokens the engines took from their prompt cache rather than computing again (of the prompt tokens).",
        ["model"],
        "cached",
    ),
    (
        "counter",
        "llmgw_gateway_routed",
        "Requests sent to a replica, by why it was that one: prefix, prefix bounded or unreachable → next, load.",
        ["model", "route"],
        "routed",
    ),
    ("gauge", "llmgw_gateway_in_flight", "Requests being answered now.", ["model"], "in_flight"),
    (
        "counter",
        "llmgw_gateway_failovers",
        "Replicas that could not be reached, each sending the request on to the next (or to a 502).",
        ["model"],
        "failovers",
    ),
    (
        "counter",
        "llmgw_gateway_key_requests",
        "Requests by API key name (only with LLMGW_METRICS_KEY_LABELS).",
        ["key", "model"],
        "key_requests",
    ),
    (
        "counter",
        "llmgw_gateway_key_tokens",
        "Prompt and completion tokens by API key name (only with LLMGW_METRICS_KEY_LABELS).",
        ["key", "model"],
        "key_tokens",
    ),
)


class GatewayCollector(Collector):
    def __init__(self, tallies: Tallies) -> None:
        self.tallies = tallies

    def collect(self):
        for kind, name, documentation, labels, tally, *buckets in FAMILIES:
            values = getattr(self.tallies, tally)
            if kind == "histogram":
                yield histogram(name, documentation, labels, buckets[0], values)
            elif kind == "gauge":
                yield gauge(name, documentation, labels, values)
            else:
                yield counter(name, documentation, labels, values)


def counter(name: str, documentation: str, labels: list[str], values: dict) -> CounterMetricFamily:
    family = CounterMetricFamily(name, documentation, labels=labels)
    for key, n in list(values.items()):
        family.add_metric(key, n)
    return family


def gauge(name: str, documentation: str, labels: list[str], values: dict) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation, labels=labels)
    for key, n in list(values.items()):
        family.add_metric(key, n)
    return family


def histogram(name: str, documentation: str, labels: list[str], bounds: tuple, values: dict) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, documentation, labels=labels)
    for key, counts in list(values.items()):
        counts = list(counts)
        cumulative, buckets = 0, []
        for bound, n in zip((*[floatToGoString(b) for b in bounds], "+Inf"), counts[:-1], strict=True):
            cumulative += n
            buckets.append((bound, cumulative))
        family.add_metric(list(key), buckets, counts[-1])
    return family


metrics.register(GatewayCollector(TALLIES))


async def scrape(scope, send) -> None:
    """The gateway's /metrics: this host's counts for Prometheus, to LLMGW_METRICS_TOKEN or an address in
    LLMGW_METRICS_ALLOW."""
    given = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
    scheme, _, token = given.partition(" ")
    client = (scope.get("client") or ("", 0))[0]
    allowed = (
        scheme.lower() in ("bearer", "token")
        and settings.METRICS_TOKEN
        and hmac.compare_digest(token.strip().encode(), settings.METRICS_TOKEN.encode())
    ) or metrics.address_allowed(client, settings.METRICS_ALLOW)
    if not allowed:
        status, body, kind = 401, b"Send LLMGW_METRICS_TOKEN as a bearer token.\n", b"text/plain; charset=utf-8"
    else:
        # Its own counts: the fleet's gauges are the admin server's to export (common/metrics.py).
        body = await asyncio.get_running_loop().run_in_executor(None, metrics.exposition, False)
        status, kind = 200, metrics.CONTENT_TYPE_PLAIN_0_0_4.encode()
    headers = [(b"content-type", kind), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="metrics"'))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
