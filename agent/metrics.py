"""The node's own `/metrics`: its facts and each engine's metrics, so one scrape per node covers it.

Off unless LLMGW_AGENT_METRICS_ADDR is set. Everything is read at scrape time:
the node's memory and disk from the system, its engines from the state file the
supervisor keeps, and each running engine's own `/metrics` (vLLM's; llama.cpp's
server where it has one) fetched over loopback and passed on with `replica` and
`model` labels added, so that two engines' series never collide. A scraper
presents `Authorization: Bearer $LLMGW_AGENT_METRICS_TOKEN`; without a token the
listener binds only to a loopback address, as the engines' health checks do.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil
import requests
from django.conf import settings
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from contracts import credentials, signing
from contracts.health import Check, verdict
from contracts.redis_client import redis_client

from . import __version__, engine_state, facts, runtime

log = logging.getLogger(__name__)

# An engine busy generating still answers its /metrics quickly; one that does not is skipped.
ENGINE_SCRAPE_TIMEOUT_S = 2.0
# A scraper sends its request at once. A client that sends nothing, or trickles its request a
# byte at a time, is cut off after this long, rather than holding one of the listener's threads
# for as long as it likes; each read and write is held to it too.
REQUEST_TIMEOUT_S = 10.0


class NodeCollector(Collector):
    def __init__(self, node: str, cache: Path, static: dict) -> None:
        self.node, self.cache, self.static = node, cache, static
        # The key of each engine's secret (contracts.credentials), from the node's token.
        self.key = signing.token_hash(runtime.token()) if runtime.token() else ""
        self.session = requests.Session()

    def collect(self):
        node = [self.node]
        info = GaugeMetricFamily("llmgw_agent_info", "This node's agent.", labels=["node", "version"])
        info.add_metric([self.node, __version__], 1)
        yield info
        memory = GaugeMetricFamily("llmgw_agent_memory_bytes", "This node's memory.", labels=["node", "kind"])
        vm = psutil.virtual_memory()
        memory.add_metric([self.node, "total"], vm.total)
        memory.add_metric([self.node, "available"], vm.available)
        yield memory
        disk = GaugeMetricFamily(
            "llmgw_agent_disk_free_bytes", "Free space where the agent keeps weights.", labels=["node"]
        )
        disk.add_metric(node, facts.disk_free_bytes(self.cache))
        yield disk
        gpus = GaugeMetricFamily("llmgw_agent_gpus", "GPUs the agent found.", labels=["node"])
        gpus.add_metric(node, len(self.static.get("gpus") or ()))
        yield gpus
        engines = GaugeMetricFamily(
            "llmgw_agent_engine_installed", "Engines installed here.", labels=["node", "engine"]
        )
        for engine in self.static.get("engines") or ():
            engines.add_metric([self.node, engine], 1)
        yield engines
        yield from self.replicas()

    def replicas(self):
        try:
            entries = list(engine_state.read_state(self.cache)["replicas"].values())
        except OSError:
            entries = []
        up = GaugeMetricFamily(
            "llmgw_agent_replica_up",
            "1 when the replica's engine runs and passed its health check.",
            labels=["node", "replica", "model", "engine"],
        )
        rss = GaugeMetricFamily(
            "llmgw_agent_replica_memory_bytes",
            "The engine's resident memory, its children included.",
            labels=["node", "replica", "model"],
        )
        restarts = GaugeMetricFamily(
            "llmgw_agent_replica_restarts",
            "Times the engine was started again after it stopped.",
            labels=["node", "replica", "model"],
        )
        passed_on: dict[str, Metric] = {}
        for entry in entries:
            replica, model = str(entry.get("replica", "")), str(entry.get("model") or "")
            running = engine_state.is_ours(entry)
            up.add_metric(
                [self.node, replica, model, str(entry.get("engine") or "")], 1 if running and entry.get("ready") else 0
            )
            restarts.add_metric([self.node, replica, model], int(entry.get("restarts") or 0))
            if not running:
                continue
            rss.add_metric([self.node, replica, model], process_tree_rss(entry["pid"]))
            if entry.get("ready") and entry.get("port"):
                secret = credentials.replica_secret(self.key, int(entry["replica"]), entry.get("nonce", ""))
                self.pass_on(entry["port"], replica, model, passed_on, secret)
        yield up
        yield rss
        yield restarts
        yield from passed_on.values()

    def pass_on(self, port: int, replica: str, model: str, into: dict[str, Metric], secret: str = "") -> None:
        """The engine's own metrics, each sample with this replica's labels added.

        With the replica's secret: llama-server answers /metrics to no one else.
        """
        host = engine_host()
        try:
            response = self.session.get(
                f"http://{host}:{port}/metrics", timeout=ENGINE_SCRAPE_TIMEOUT_S, headers=credentials.bearer(secret)
            )
        except requests.RequestException:
            return
        if response.status_code != 200:
            return  # an engine without /metrics: its facts above are what there is
        try:
            families = list(text_string_to_metric_families(response.text))
        except ValueError as error:
            log.warning("replica %s answered /metrics that do not parse: %s", replica, error)
            return
        for family in families:
            mine = into.get(family.name)
            if mine is None:
                mine = into[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            for sample in family.samples:
                labels = dict(sample.labels, replica=replica, model=model, node=self.node)
                mine.add_sample(sample.name, labels, sample.value, sample.timestamp, sample.exemplar)


def process_tree_rss(pid: int) -> int:
    try:
        root = psutil.Process(pid)
        return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
    except psutil.Error:
        return 0


def engine_host() -> str:
    host = settings.LLMGW_ENGINE_HOST
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_addr(raw: str) -> tuple[str, int]:
    host, sep, port = raw.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"LLMGW_AGENT_METRICS_ADDR={raw!r} is not HOST:PORT")
    return host.strip("[]") or "0.0.0.0", int(port)


def problem() -> str | None:
    """Why the agent's /metrics cannot be served as configured, in a sentence; None when it can."""
    raw = settings.AGENT_METRICS_ADDR
    if not raw:
        return None
    try:
        host, _ = parse_addr(raw)
    except ValueError as error:
        return str(error)
    if not settings.AGENT_METRICS_TOKEN and not is_loopback(host):
        return (
            f"LLMGW_AGENT_METRICS_ADDR={raw} is reachable from other hosts, so it needs LLMGW_AGENT_METRICS_TOKEN: "
            "the bearer token a scraper presents."
        )
    return None


def health_checks(cache: Path) -> list[Check]:
    """What a node needs to do its work: the broker its orders come through, and a cache it can write."""

    def broker() -> None:
        redis_client(settings.CELERY_BROKER_URL, timeout=2.0).ping()

    def weights() -> str:
        probe = cache / ".healthz"
        probe.write_bytes(b"")
        probe.unlink()
        return f"{facts.disk_free_bytes(cache) // 2**30} GiB free"

    return [
        Check("broker", broker, without="hears no orders and sends no heartbeats"),
        Check("cache", weights, without="cannot keep weights"),
    ]


def serve(node: str, cache: Path) -> ThreadingHTTPServer | None:
    """Start the node's /metrics in a thread when LLMGW_AGENT_METRICS_ADDR is set; None when it is not."""
    if not settings.AGENT_METRICS_ADDR:
        return None
    host, port = parse_addr(settings.AGENT_METRICS_ADDR)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(NodeCollector(node, cache, facts.installed()))
    token = settings.AGENT_METRICS_TOKEN.encode()
    handler = type("Handler", (MetricsHandler,), {"registry": registry, "token": token, "cache": cache})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    # A client cut off, or gone, is not the agent's error.
    server.handle_error = lambda request, client_address: log.debug("metrics: %s went away", client_address)
    threading.Thread(target=server.serve_forever, name="agent-metrics", daemon=True).start()
    return server


class MetricsHandler(BaseHTTPRequestHandler):
    """/metrics (behind the token, when there is one) and /healthz; `serve` gives it its registry, token and cache."""

    timeout = REQUEST_TIMEOUT_S
    registry: CollectorRegistry
    token: bytes
    cache: Path

    def setup(self) -> None:
        super().setup()
        # The whole request, however it trickles: a read's own timeout starts again at every byte.
        self.deadline = threading.Timer(REQUEST_TIMEOUT_S, self.cut_off)
        self.deadline.daemon = True
        self.deadline.start()

    def cut_off(self) -> None:
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # closed meanwhile

    def finish(self) -> None:
        self.deadline.cancel()
        super().finish()

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self.deadline.cancel()  # the request is in; answering it is held to each write's timeout
        if self.path.split("?")[0] == "/healthz":
            # Open like the other processes' /healthz: it names what it checked, nothing more.
            status, body = verdict("agent", health_checks(self.cache))
            return self._answer(status, body, "application/json")
        if self.path.split("?")[0] != "/metrics":
            return self._answer(404, b"Only /metrics and /healthz are here.\n", "text/plain")
        if self.token:
            scheme, _, given = self.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.token):
                return self._answer(
                    401, b"Scraping needs 'Authorization: Bearer <LLMGW_AGENT_METRICS_TOKEN>'.\n", "text/plain"
                )
        try:
            body = generate_latest(self.registry)
        except Exception:
            log.exception("the node's metrics could not be collected")
            return self._answer(
                500, b"The node's metrics could not be collected; the agent's log says why.\n", "text/plain"
            )
        self._answer(200, body, CONTENT_TYPE_PLAIN_0_0_4)

    def _answer(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        if status == 401:
            self.send_header("WWW-Authenticate", 'Bearer realm="metrics"')
        self.end_headers()
        self.wfile.write(body)
