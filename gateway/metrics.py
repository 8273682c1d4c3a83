"""What the gateway counts and logs about each request: Prometheus metrics, X-Request-Id, the access log.

The gateway's code calls four hooks (`begin`, `routed`, `failover`, `answered`)
and this module keeps the rest out of its way. Everything here runs on the event
loop for every request, so it does in-memory arithmetic and nothing else: the
counters are prometheus_client's (a lock and an add), the access log line is one
write, and the hourly counts the overview draws go to Redis from a thread.

Labels stay bounded: a model label is a catalog name (a name the client made up
is counted as ""), a key label is a key's name and only with LLMGW_METRICS_KEY_LABELS,
and nothing of a request's content is ever a label or a log field.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import sys
import threading
import time
from logging.handlers import WatchedFileHandler

from django.conf import settings
from prometheus_client import Counter, Gauge, Histogram

from fleet.live import redis_client

log = logging.getLogger("llmgw.gateway")

KINDS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
    "/v1/embeddings": "embedding",
}
# Seconds: from a fast stub's sub-millisecond answer to a long generation.
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
ADDED_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)

REQUESTS = Counter("llmgw_gateway_requests", "Requests the gateway answered.", ["model", "kind", "stream", "status"])
DURATION = Histogram(
    "llmgw_gateway_request_duration_seconds",
    "From a request's arrival to the end of its answer.",
    ["model", "kind"],
    buckets=DURATION_BUCKETS,
)
FIRST_TOKEN = Histogram(
    "llmgw_gateway_time_to_first_token_seconds",
    "Streamed answers: from the request's arrival to the first event passed on.",
    ["model"],
    buckets=DURATION_BUCKETS,
)
ADDED = Histogram(
    "llmgw_gateway_added_seconds",
    "The gateway's own time: from a request's arrival to sending it on to a replica.",
    buckets=ADDED_BUCKETS,
)
PROMPT_TOKENS = Counter("llmgw_gateway_prompt_tokens", "Prompt tokens, as the engines counted them.", ["model"])
COMPLETION_TOKENS = Counter(
    "llmgw_gateway_completion_tokens", "Completion tokens, as the engines counted them.", ["model"]
)
IN_FLIGHT = Gauge("llmgw_gateway_in_flight", "Requests being answered now.", ["model"], multiprocess_mode="livesum")
FAILOVERS = Counter(
    "llmgw_gateway_failovers", "Requests sent on to another replica after one could not be reached.", ["model"]
)
KEY_REQUESTS = Counter(
    "llmgw_gateway_key_requests", "Requests by API key name (only with LLMGW_METRICS_KEY_LABELS).", ["key", "model"]
)
KEY_TOKENS = Counter(
    "llmgw_gateway_key_tokens",
    "Prompt and completion tokens by API key name (only with LLMGW_METRICS_KEY_LABELS).",
    ["key", "model"],
)

# A client's own request id is passed on only when it is short and plain: it goes into
# headers and log lines, where anything else could forge a second header or line.
REQUEST_ID = re.compile(rb"[A-Za-z0-9._:/=+-]{1,128}")
SCOPE_KEY = "llmgw.exchange"

# The overview's "last 24 hours": requests and tokens per model and hour, in Redis.
HOUR_PREFIX = "llmgw:usage-hour:"
HOUR_KEEP_S = 26 * 3600
HOURS_FLUSH_S = 1.0


class Exchange:
    """One request as the gateway saw it, for its metrics and its access log line."""

    __slots__ = (
        "started",
        "request_id",
        "kind",
        "model",
        "stream",
        "status",
        "first_byte",
        "replica",
        "prompt",
        "completion",
        "key",
        "added",
    )

    def __init__(self, started: float, request_id: bytes, kind: str) -> None:
        self.started = started
        self.request_id = request_id
        self.kind = kind
        self.model = ""
        self.stream = False
        self.status = 0
        self.first_byte = 0.0
        self.replica = 0
        self.prompt = 0
        self.completion = 0
        self.key = ""
        self.added = 0.0


class Observer:
    def __init__(self) -> None:
        self.metrics = settings.GATEWAY_METRICS
        self.key_labels = settings.METRICS_KEY_LABELS
        self.access = access_logger(settings.GATEWAY_ACCESS_LOG)
        self._hours: dict[tuple[str, str], list[int]] = {}
        self._hours_lock = threading.Lock()
        self._hours_flushed = time.monotonic()
        self._hours_failing = False

    def begin(self, scope, send, started: float):
        """The exchange for this request, and a `send` that notes its status and stamps X-Request-Id."""
        given = b""
        for header, value in scope["headers"]:
            if header == b"x-request-id":
                given = value
                break
        request_id = given if given and REQUEST_ID.fullmatch(given) else os.urandom(12).hex().encode()
        exchange = Exchange(started, request_id, KINDS.get(scope["path"], "other"))
        scope[SCOPE_KEY] = exchange

        async def observed_send(message) -> None:
            if message["type"] == "http.response.start":
                exchange.status = message["status"]
                message["headers"] = [*message["headers"], (b"x-request-id", request_id)]
            elif not exchange.first_byte and message.get("body"):
                exchange.first_byte = time.perf_counter()
            await send(message)

        return exchange, observed_send

    def end(self, exchange: Exchange) -> None:
        now = time.perf_counter()
        status = exchange.status or 499  # nothing was sent: the client left first
        model = exchange.model
        if self.metrics:
            if model:
                IN_FLIGHT.labels(model).dec()
            REQUESTS.labels(model, exchange.kind, "true" if exchange.stream else "false", str(status)).inc()
            if model:
                DURATION.labels(model, exchange.kind).observe(now - exchange.started)
                if exchange.replica:
                    ADDED.observe(exchange.added)
                    if exchange.prompt:
                        PROMPT_TOKENS.labels(model).inc(exchange.prompt)
                    if exchange.completion:
                        COMPLETION_TOKENS.labels(model).inc(exchange.completion)
                if exchange.stream and exchange.first_byte and status == 200:
                    FIRST_TOKEN.labels(model).observe(exchange.first_byte - exchange.started)
                if self.key_labels and exchange.key:
                    KEY_REQUESTS.labels(exchange.key, model).inc()
                    if exchange.prompt or exchange.completion:
                        KEY_TOKENS.labels(exchange.key, model).inc(exchange.prompt + exchange.completion)
        if model and exchange.replica:
            self._count_hour(model, exchange.prompt, exchange.completion)
        if self.access is not None:
            self.access.info(access_line(exchange, status, now))

    # --- hooks the gateway calls -------------------------------------------------

    def routed(self, scope, model: str, request: dict, key_name: str) -> None:
        exchange = scope[SCOPE_KEY]
        exchange.model = model
        exchange.stream = request.get("stream") is True
        exchange.key = key_name
        if self.metrics:
            IN_FLIGHT.labels(model).inc()

    def failover(self, scope) -> None:
        if self.metrics:
            FAILOVERS.labels(scope[SCOPE_KEY].model).inc()

    def answered(self, scope, replica: int, added_s: float, prompt: int, completion: int) -> None:
        exchange = scope[SCOPE_KEY]
        exchange.replica, exchange.added, exchange.prompt, exchange.completion = replica, added_s, prompt, completion

    # --- the overview's hourly counts ---------------------------------------------

    def _count_hour(self, model: str, prompt: int, completion: int) -> None:
        hour = time.strftime("%Y%m%d%H", time.gmtime())
        with self._hours_lock:
            counts = self._hours.setdefault((hour, model), [0, 0, 0])
            counts[0] += 1
            counts[1] += prompt
            counts[2] += completion
        if time.monotonic() - self._hours_flushed >= HOURS_FLUSH_S:
            self._hours_flushed = time.monotonic()
            asyncio.get_running_loop().run_in_executor(None, self.flush_hours)

    def flush_hours(self) -> None:
        """Write the hourly counts to Redis; kept for the next try when Redis is away."""
        with self._hours_lock:
            counts, self._hours = self._hours, {}
        if not counts:
            return
        try:
            pipe = redis_client().pipeline(transaction=False)
            for (hour, model), (requests, prompt, completion) in counts.items():
                key = HOUR_PREFIX + hour
                pipe.hincrby(key, f"{model}\trequests", requests)
                pipe.hincrby(key, f"{model}\tprompt", prompt)
                pipe.hincrby(key, f"{model}\tcompletion", completion)
                pipe.expire(key, HOUR_KEEP_S)
            pipe.execute()
            self._hours_failing = False
        except Exception as error:
            if not self._hours_failing:  # once, not every second while Redis is away
                log.warning("hourly usage not written to Redis (%s); kept until it can be", error)
            self._hours_failing = True
            with self._hours_lock:
                for where, (requests, prompt, completion) in counts.items():
                    mine = self._hours.setdefault(where, [0, 0, 0])
                    mine[0] += requests
                    mine[1] += prompt
                    mine[2] += completion


def access_logger(where: str) -> logging.Logger | None:
    """The access log: off when unset, stdout for "-", else a file (reopened when rotated away)."""
    if not where:
        return None
    logger = logging.getLogger("llmgw.access")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    if not logger.handlers:
        if where == "-":
            handler = logging.StreamHandler(sys.stdout)
        else:
            handler = WatchedFileHandler(where)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    return logger


def access_line(exchange: Exchange, status: int, now: float) -> str:
    return json.dumps(
        {
            "ts": round(time.time(), 3),
            "request_id": exchange.request_id.decode(),
            "kind": exchange.kind,
            "model": exchange.model,
            "key": exchange.key,
            "replica": exchange.replica or None,
            "status": status,
            "stream": exchange.stream,
            "prompt_tokens": exchange.prompt,
            "completion_tokens": exchange.completion,
            "duration_ms": round((now - exchange.started) * 1000, 3),
            "first_byte_ms": round((exchange.first_byte - exchange.started) * 1000, 3) if exchange.first_byte else None,
            "gateway_ms": round(exchange.added * 1000, 3) if exchange.replica else None,
        },
        separators=(",", ":"),
    )


def request_id(scope) -> str:
    return scope[SCOPE_KEY].request_id.decode()
