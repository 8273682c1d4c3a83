"""What the gateway counts and logs about each request: Prometheus metrics, X-Request-Id, the access log.

The gateway's code calls four hooks (`begin`, `routed`, `failover`, `answered`)
and this module keeps the rest out of its way. Everything here runs on the event
loop for every request, so it does in-memory arithmetic and nothing else: the
counts are plain numbers that a prometheus_client collector reads at scrape time (prometheus.py),
the access log line is one write, and the hourly counts the overview draws go to
Redis from a thread.

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
import uuid

from django.conf import settings

from fleet import routing
from fleet.live import redis_client

from .endpoints import ENDPOINTS
from .prometheus import ADDED_BUCKETS, DURATION_BUCKETS, TALLIES, add, observe, share_counts

log = logging.getLogger("llmgw.gateway")


def metric_kind(path: str) -> str:
    endpoint = ENDPOINTS.get(path)
    return endpoint.metric if endpoint else "other"


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
        "engine_id",
        "kind",
        "model",
        "stream",
        "status",
        "first_byte",
        "replica",
        "prompt",
        "completion",
        "cached",
        "route",
        "key",
        "added",
    )

    def __init__(self, started: float, request_id: bytes, engine_id: bytes, kind: str) -> None:
        self.started = started
        self.request_id = request_id
        self.engine_id = engine_id
        self.kind = kind
        self.model = ""
        self.stream = False
        self.status = 0
        self.first_byte = 0.0
        self.replica = 0
        self.prompt = 0
        self.completion = 0
        self.cached = 0
        self.route = ""
        self.key = ""
        self.added = 0.0


class Observer:
    def __init__(self) -> None:
        self.metrics = settings.GATEWAY_METRICS
        if self.metrics:
            share_counts()  # with --workers N only: a scrape shows the whole gateway's counts
        self.key_labels = settings.METRICS_KEY_LABELS
        self.access = AccessLog(settings.GATEWAY_ACCESS_LOG) if settings.GATEWAY_ACCESS_LOG else None
        self._hours: dict[tuple[str, str], list[int]] = {}
        self._routes: dict[tuple[str, int, str], int] = {}
        self._recent: dict[int, list[dict]] = {}
        self._hours_lock = threading.Lock()
        self._hours_flush_due = False
        self._hours_failing = False
        self._hour, self._hour_ends = "", 0.0

    def begin(self, scope, send, started: float):
        """The exchange for this request, and a `send` that notes its status and stamps X-Request-Id."""
        given = b""
        for header, value in scope["headers"]:
            if header == b"x-request-id":
                given = value
                break
        if given and REQUEST_ID.fullmatch(given):
            request_id = given
            engine_id = given if is_uuid(given) else os.urandom(16).hex().encode()
        else:
            request_id = engine_id = os.urandom(16).hex().encode()
        exchange = Exchange(started, request_id, engine_id, metric_kind(scope["path"]))
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
            t = TALLIES
            add(t.requests, (model, exchange.kind, "true" if exchange.stream else "false", str(status)))
            if model:
                add(t.in_flight, (model,), -1)
                observe(t.duration, (model, exchange.kind), DURATION_BUCKETS, now - exchange.started)
                if exchange.replica:
                    observe(t.added, (), ADDED_BUCKETS, exchange.added)
                    add(t.prompt, (model,), exchange.prompt)
                    add(t.completion, (model,), exchange.completion)
                    add(t.cached, (model,), exchange.cached)
                    add(t.routed, (model, exchange.route))
                if exchange.stream and exchange.first_byte and status == 200:
                    observe(t.first_token, (model,), DURATION_BUCKETS, exchange.first_byte - exchange.started)
                if self.key_labels and exchange.key:
                    add(t.key_requests, (exchange.key, model))
                    add(t.key_tokens, (exchange.key, model), exchange.prompt + exchange.completion)
        if model and exchange.replica:
            self._count_hour(exchange)
        if self.access is not None:
            self.access.write(access_line(exchange, status, now))

    # --- hooks the gateway calls -------------------------------------------------

    def routed(self, scope, model: str, request: dict, key_name: str) -> None:
        exchange = scope[SCOPE_KEY]
        exchange.model = model
        exchange.stream = request.get("stream") is True
        exchange.key = key_name
        if self.metrics:
            add(TALLIES.in_flight, (model,))

    def failover(self, scope) -> None:
        if self.metrics:
            add(TALLIES.failovers, (scope[SCOPE_KEY].model,))

    def answered(
        self, scope, replica: int, added_s: float, prompt: int, completion: int, cached: int = 0, route: str = ""
    ) -> None:
        exchange = scope[SCOPE_KEY]
        exchange.replica, exchange.added, exchange.prompt, exchange.completion = replica, added_s, prompt, completion
        exchange.cached, exchange.route = cached, route

    # --- the overview's hourly counts ---------------------------------------------

    def _count_hour(self, exchange: Exchange) -> None:
        now = time.time()
        if now >= self._hour_ends:
            self._hour = time.strftime("%Y%m%d%H", time.gmtime(now))
            self._hour_ends = (now // 3600 + 1) * 3600
        hour = self._hour
        with self._hours_lock:
            counts = self._hours.setdefault((hour, exchange.model), [0, 0, 0, 0])
            counts[0] += 1
            counts[1] += exchange.prompt
            counts[2] += exchange.completion
            counts[3] += exchange.cached
            # Why it went to its replica, for the replica's page (fleet/routing.py).
            where = (hour, exchange.replica, exchange.route)
            self._routes[where] = self._routes.get(where, 0) + 1
            self._recent.setdefault(exchange.replica, []).append(
                {
                    "at": round(now, 1),
                    "model": exchange.model,
                    "route": exchange.route,
                    "prompt": exchange.prompt,
                    "cached": exchange.cached,
                }
            )
            if len(self._recent[exchange.replica]) > 2 * routing.RECENT:
                del self._recent[exchange.replica][: -routing.RECENT]
        if not self._hours_flush_due:
            # Written a second later, from a thread, with whatever else came in meanwhile.
            self._hours_flush_due = True
            loop = asyncio.get_running_loop()
            loop.call_later(HOURS_FLUSH_S, loop.run_in_executor, None, self.flush_hours)

    def flush_hours(self) -> None:
        """Write the hourly counts to Redis; kept for the next try when Redis is away."""
        with self._hours_lock:
            counts, self._hours = self._hours, {}
            routes, self._routes = self._routes, {}
            recent, self._recent = self._recent, {}
            self._hours_flush_due = False
        if not counts:
            return
        try:
            pipe = redis_client().pipeline(transaction=False)
            for (hour, model), (requests, prompt, completion, cached) in counts.items():
                key = HOUR_PREFIX + hour
                pipe.hincrby(key, f"{model}\trequests", requests)
                pipe.hincrby(key, f"{model}\tprompt", prompt)
                pipe.hincrby(key, f"{model}\tcompletion", completion)
                pipe.hincrby(key, f"{model}\tcached", cached)
                pipe.expire(key, HOUR_KEEP_S)
            for (hour, replica, route), requests in routes.items():
                routing.add(pipe, hour, replica, route, requests)
            for replica, latest in recent.items():
                routing.note(pipe, replica, latest[-routing.RECENT :])
            pipe.execute()
            self._hours_failing = False
        except Exception as error:
            if not self._hours_failing:  # once, not every second while Redis is away
                log.warning("hourly usage not written to Redis (%s); kept until it can be", error)
            self._hours_failing = True
            with self._hours_lock:
                for where, added in counts.items():
                    mine = self._hours.setdefault(where, [0, 0, 0, 0])
                    for i, n in enumerate(added):
                        mine[i] += n
                for where, n in routes.items():
                    self._routes[where] = self._routes.get(where, 0) + n
                # The latest requests of a flush that failed are not kept: newer ones replace them.


class AccessLog:
    """JSON lines, one write each: to stdout for "-", else to a file, reopened when rotated away.

    Not the logging module: its records, handlers and locks cost more per line than
    the rest of the gateway's own work, and a line a request is the hot path.
    """

    # How often the file is checked for having been moved away (logrotate), in seconds.
    CHECK_S = 1.0

    def __init__(self, where: str) -> None:
        self.path = None if where == "-" else where
        self._checked = time.monotonic()
        self._file = sys.stdout if self.path is None else self._open()

    def _open(self):
        return open(self.path, "a", buffering=1, encoding="utf-8")  # line-buffered: one write(2) a line

    def write(self, line: str) -> None:
        if self.path is not None and time.monotonic() - self._checked > self.CHECK_S:
            self._checked = time.monotonic()
            self._reopen_if_moved()
        try:
            self._file.write(line + "\n")
            if self.path is None:
                self._file.flush()
        except OSError as error:
            log.warning("the access log could not be written: %s", error)

    def _reopen_if_moved(self) -> None:
        try:
            moved = os.stat(self.path).st_ino != os.fstat(self._file.fileno()).st_ino
        except OSError:
            moved = True
        if moved:
            self._file.close()
            self._file = self._open()


def access_line(exchange: Exchange, status: int, now: float) -> str:
    return json.dumps(
        {
            "ts": round(time.time(), 3),
            "request_id": exchange.request_id.decode(),
            "engine_request_id": exchange.engine_id.decode() if exchange.engine_id != exchange.request_id else None,
            "kind": exchange.kind,
            "model": exchange.model,
            "key": exchange.key,
            "replica": exchange.replica or None,
            "status": status,
            "stream": exchange.stream,
            "prompt_tokens": exchange.prompt,
            "completion_tokens": exchange.completion,
            "cached_tokens": exchange.cached,
            "route": exchange.route or None,
            "duration_ms": round((now - exchange.started) * 1000, 3),
            "first_byte_ms": round((exchange.first_byte - exchange.started) * 1000, 3) if exchange.first_byte else None,
            "gateway_ms": round(exchange.added * 1000, 3) if exchange.replica else None,
        },
        separators=(",", ":"),
    )


def engine_request_id(scope) -> str:
    """The id the engine is given: the request's own, unless the engine could not take it (see is_uuid)."""
    return scope[SCOPE_KEY].engine_id.decode()


def is_uuid(given: bytes) -> bool:
    """PyPI's llama.cpp server (starlette-context) answers a bare 400 to an X-Request-Id that is not a UUID.

    So a client's id of another shape is kept for the answer and the log, and the
    engine is given a new UUID, which the log line records beside it.
    """
    try:
        uuid.UUID(given.decode())
    except ValueError:
        return False
    return True
