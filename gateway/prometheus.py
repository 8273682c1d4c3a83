"""The gateway's counts for Prometheus: plain numbers the event loop adds to, the collector that reads them at
scrape time, and the gateway's /metrics that serves them.

metrics.py's Observer does the counting, from its hooks; labels stay bounded as it says.
With `--workers N` the processes of one gateway share their counts through snapshot files
(`Shared`), so a scrape, whichever process takes it, shows the whole gateway's.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import re
import threading
import time
from bisect import bisect_left
from pathlib import Path

from django.conf import settings
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from common import metrics

log = logging.getLogger("llmgw.gateway")

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
        self.shared: Shared | None = None

    def collect(self):
        counts = self.shared.whole_gateway() if self.shared else vars(self.tallies)
        for kind, name, documentation, labels, tally, *buckets in FAMILIES:
            values = counts[tally]
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


COLLECTOR = GatewayCollector(TALLIES)
metrics.register(COLLECTOR)


# --- one gateway's processes (--workers N) -------------------------------------------

# Set by `manage.py gateway --workers N` for its processes: the directory they share their counts through.
SHARED_DIR_ENV = "LLMGW_GATEWAY_COUNTS_DIR"
SNAPSHOT_S = 1.0
GAUGES = {family[4] for family in FAMILIES if family[0] == "gauge"}


def shared_dir(var_dir: Path, host: str, port: int) -> Path:
    """The directory of the gateway on host:port, under LLMGW_VAR: two gateways on one host do not mix."""
    return Path(var_dir) / "gateway-counts" / re.sub(r"[^A-Za-z0-9.-]", "_", f"{host}-{port}")


class Shared:
    """This process's counts written to the gateway's directory about once a second, from a thread, and the
    other processes' last ones read at scrape time.

    Not prometheus_client's multiprocess mode, which the gateway avoids on purpose: it takes a lock and
    writes an mmap'd file on every update, on the request path. Here the request path is unchanged; a
    snapshot is a copy of the dicts (as a scrape makes) and one file, written whole and renamed into place
    so a reader never sees half of one. A process that died keeps its last file, so the sums never go
    down (rate() would read a reset), but its gauges (requests in flight) are no longer added. A scrape
    writes its own process's snapshot first and reports that: what a scrape showed of a process is always
    in its file, so a later scrape by another process cannot show less of it.
    """

    def __init__(self, tallies: Tallies, directory: Path) -> None:
        self.tallies = tallies
        self.directory = Path(directory)
        self.pid = os.getpid()
        self.path = self.directory / f"{self.pid}.json"
        self._writing = threading.Lock()
        self._failing = False

    def start(self) -> None:
        threading.Thread(target=self._write_forever, name="gateway-counts", daemon=True).start()

    def _write_forever(self) -> None:
        while True:
            time.sleep(SNAPSHOT_S)  # a clock, not a wait for something
            self.write()

    def write(self) -> dict:
        """This process's counts now, also written to its file (kept for the next try when the write fails)."""
        with self._writing:
            counts = snapshot(self.tallies)
            staged = self.path.with_suffix(".tmp")
            try:
                staged.write_text(json.dumps({name: list(values.items()) for name, values in counts.items()}))
                os.replace(staged, self.path)
                self._failing = False
            except OSError as error:
                if not self._failing:  # once, not every second
                    log.warning("the gateway's counts could not be shared with its other processes: %s", error)
                self._failing = True
        return counts

    def others(self):
        """(counts, alive) of every other process of this gateway that wrote a snapshot, this run."""
        for path in self.directory.glob("*.json"):
            if path == self.path or not path.stem.isdigit():
                continue
            try:
                written = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            counts = {name: {tuple(labels): value for labels, value in values} for name, values in written.items()}
            yield counts, alive(int(path.stem))

    def whole_gateway(self) -> dict:
        whole = self.write()
        for counts, running in self.others():
            for name, values in counts.items():
                if name not in whole or (name in GAUGES and not running):
                    continue
                into = whole[name]
                for labels, value in values.items():
                    mine = into.get(labels)
                    if mine is None:
                        into[labels] = list(value) if isinstance(value, list) else value
                    elif isinstance(mine, list):
                        into[labels] = [a + b for a, b in zip(mine, value, strict=True)]
                    else:
                        into[labels] = mine + value
        return whole


def snapshot(tallies: Tallies) -> dict:
    """A copy of every count: dicts and their histograms' lists, each copied without letting the loop in."""
    return {
        name: {labels: list(value) if isinstance(value, list) else value for labels, value in list(values.items())}
        for name, values in vars(tallies).items()
    }


def alive(pid: int) -> bool:
    """Whether the process is there (a pid the kernel gave again to another process counts as there: rare, and
    only its gauges would be added)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def share_counts() -> None:
    """Under `manage.py gateway --workers N`: share this process's counts with the gateway's others."""
    directory = os.environ.get(SHARED_DIR_ENV)
    if directory and COLLECTOR.shared is None:
        COLLECTOR.shared = Shared(TALLIES, Path(directory))
        COLLECTOR.shared.start()


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
