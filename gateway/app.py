"""The OpenAI-compatible gateway: `/v1/` on a port of its own (`manage.py gateway`), as a bare ASGI application.

Why not a Django view: a request through Django's handler and middleware costs
about a millisecond before any work is done, and the gateway's whole budget is
a couple of milliseconds. So the hot path is plain asyncio: the routing table
is a snapshot in memory (see routes.py), the replica is reached over kept-alive
connections, and the answer is passed on chunk by chunk. Django is still where
keys, models and replicas are kept and edited; the gateway reads them in a
thread of its own. Passing a request on to a replica is in forward.py.

The gateway is the data plane: when the database cannot be read it goes on
routing by the last table it read, for as long as that lasts, and /v1/models
says since when the table is stale; usage waits in the spool (usage.py).
"""

from __future__ import annotations

import asyncio
import functools
import gc
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

import aiohttp
from django.conf import settings
from django.db import connection

from contracts.health import Check, verdict

from . import endpoints, hold, intake, listing, metrics, prometheus, prospects, routes
from .conversations import Conversations
from .demand import Demand
from .errors import ClientGone, Refusal
from .forward import Forwarding
from .intake import Taken, read_body
from .keys import hash_key
from .limits import Limiter, Ticket
from .relay import timing
from .request import HangUp, Request
from .upstream import IDLE_S, upstream_socket
from .usage import Recorder, cost, micro_units, one_line, prompt_estimate

log = logging.getLogger("llmgw.gateway")

# A key the table does not know makes the gateway re-read the table, at most this often.
KEY_MISS_REFRESH_S = 0.25
JSON_TYPE = (b"content-type", b"application/json")


# A body larger than this is parsed and translated in a thread rather than on the event loop.
PARSE_INLINE_BYTES = 64 * 1024


def reserves(key: routes.Key) -> bool:
    """Whether a key's request holds tokens or money once its body is read (gateway/limits/scripts.py RESERVE)."""
    return key.budget is not None or any(key.limits.tokens)


def small(scope) -> bool:
    """Whether a request says its body is small enough to be read before it is admitted, at no cost."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            return value.isdigit() and int(value) <= PARSE_INLINE_BYTES
    return False


class Gateway(Forwarding):
    """The ASGI application; what it does with a routed request is in gateway/forward.py."""

    def __init__(self) -> None:
        self.table = routes.Table()
        self.in_flight: dict[int, int] = {}
        self.cooling: dict[int, float] = {}
        self.usage = Recorder(settings.GATEWAY_SPOOL)
        # Wall-clock times: the last table read, and the first failed read since (None: fresh).
        self.table_read_at: float | None = None
        self.stale_since: float | None = None
        self.limiter = Limiter()
        self._reader = routes.TableReader()
        self.refresh_s = settings.GATEWAY_REFRESH_MS / 1000
        self._db = ThreadPoolExecutor(1, thread_name_prefix="gateway-db")
        self._parsers = ThreadPoolExecutor(2, thread_name_prefix="gateway-parse")
        self.key_flights: dict[int, int] = {}  # each key's requests in this process, from its admission
        self._session: aiohttp.ClientSession | None = None
        self._fresh_session: aiohttp.ClientSession | None = None
        self._refresher: asyncio.Task | None = None
        self._refreshing: asyncio.Future | None = None
        self._last_refresh_start = 0.0
        self._turn = 0
        self.observer = metrics.Observer()
        self.conversations = Conversations()  # where new conversations started (gateway/conversations.py)
        self.demand = Demand(self.in_flight, self.conversations)
        self.holding = hold.Holding(
            self.demand, settings.HOLD_S, settings.HOLD_QUEUE, lambda: self.table, settings.HOLD_QUEUE_PER_KEY
        )

    # --- life -----------------------------------------------------------------

    async def start(self) -> None:
        if self._session is not None:
            return
        sockets = dict(limit=0, ttl_dns_cache=60, socket_factory=upstream_socket)
        answers = dict(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=settings.GATEWAY_UPSTREAM_TIMEOUT_S),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(keepalive_timeout=IDLE_S, **sockets), **answers
        )
        # A request resent after its kept-alive connection was dropped goes on a connection of its
        # own (gateway/forward.py): the pool may hold more that the engine has let go.
        self._fresh_session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(force_close=True, **sockets), **answers
        )
        await self.refresh()
        self._refresher = asyncio.get_running_loop().create_task(self._refresh_forever())
        self.demand.start()
        # Everything loaded so far (Django, the admin, the apps) lives as long as the process.
        # Moved out of the collector's reach, it is not walked again by every full collection,
        # which otherwise stalls the event loop for tens of milliseconds at a time.
        gc.collect()
        gc.freeze()

    async def stop(self) -> None:
        if self._refresher:
            self._refresher.cancel()
        if self._session:
            await self._session.close()
            await self._fresh_session.close()
            self._session = None
        await self.limiter.close()
        await self.demand.stop()
        await asyncio.get_running_loop().run_in_executor(self._db, self._flush_usage)
        self.usage.close()

    async def lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self.start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # --- the table --------------------------------------------------------------

    async def _refresh_forever(self) -> None:
        while True:
            # Faster while requests wait for a replica: they go the moment the table has one.
            await self.holding.sleep(self.refresh_s)
            await self.refresh()

    async def refresh(self) -> None:
        """Read the table again; one read at a time, and callers meanwhile wait for that one."""
        if self._refreshing is not None:
            await asyncio.shield(self._refreshing)
            return
        loop = asyncio.get_running_loop()
        self._refreshing = loop.create_future()
        self._last_refresh_start = time.monotonic()
        try:
            table = await loop.run_in_executor(self._db, self._read_table)
            for replica in hold.moved(self.table, table):
                self.cooling.pop(replica, None)  # started again elsewhere: worth a try at once
            self.table = table
            self.holding.release(table, self.cooling)
            self._table_read(table)
        except Exception as error:
            # The old table keeps routing; the next refresh tries again.
            self._table_not_read(error)
        finally:
            self._refreshing.set_result(None)
            self._refreshing = None

    def _table_read(self, table: routes.Table) -> None:
        if self.table_read_at is None:
            log.info("the gateway read its table: %d models, %d keys; serving", len(table.models), len(table.keys))
        elif self.stale_since is not None:
            log.warning("the gateway reads its table again, stale since %s", iso(self.stale_since))
        self.table_read_at, self.stale_since = time.time(), None

    def _table_not_read(self, error: Exception) -> None:
        # Said once when it begins, in one line: an outage of an hour is not 3,600 tracebacks.
        if self.stale_since is not None:
            return
        self.stale_since = time.time()
        if self.table_read_at is None:
            log.warning(
                "the gateway cannot read its table from the database yet (%s); it answers 503 until it can, "
                "and tries again every %.1f s",
                one_line(error),
                self.refresh_s,
            )
        else:
            log.warning(
                "the gateway cannot read its table (%s); it serves the table read at %s until it can",
                one_line(error),
                iso(self.table_read_at),
            )

    def table_state(self) -> dict:
        """What /v1/models says of the table it lists: when it was read, and since when it is stale."""
        return {
            "read_at": iso(self.table_read_at) if self.table_read_at else None,
            "stale": self.stale_since is not None,
            "stale_since": iso(self.stale_since) if self.stale_since else None,
        }

    async def refresh_since(self, asked: float) -> None:
        """A table read that began after `asked`: what a key made a moment ago needs.

        At most one such read each KEY_MISS_REFRESH_S, so a stream of wrong keys
        cannot keep the database busy; a wrong key waits that long for its 401.
        """
        wait = self._last_refresh_start + KEY_MISS_REFRESH_S - asked
        if wait > 0:
            await asyncio.sleep(wait)
        while self._last_refresh_start < asked:
            await self.refresh()
        if self._refreshing is not None:
            # A periodic read that began during the wait above counts, but only once it has ended.
            await asyncio.shield(self._refreshing)

    def _read_table(self) -> routes.Table:
        # The thread keeps its connection between reads: a read with nothing changed is
        # two small queries, and connecting again each second would cost more than both.
        # A connection that failed is closed, so the next read connects anew.
        try:
            self._flush_usage()
            return self._reader.read()
        except Exception:
            connection.close()
            raise

    def _flush_usage(self) -> None:
        try:
            self.usage.flush()
        except Exception:
            pass  # kept in the spool for the next try; usage.py says so once

    # --- requests --------------------------------------------------------------

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self.lifespan(receive, send)
            return
        if scope["path"] == "/metrics":
            await prometheus.scrape(scope, send)
            return
        if scope["path"] == "/healthz":
            await self.health(send)
            return
        started = time.perf_counter()
        if self._session is None:
            await self.start()
        exchange, send = self.observer.begin(scope, send, started)
        try:
            await self.handle(scope, receive, send, started)
        except Refusal as refusal:
            await self.refuse(send, refusal, started, endpoints.dialect_of(scope.get("path", "")))
        except ClientGone:
            pass
        except Exception:
            # A fault of the gateway's own: said in the client's shape, and in the log with its traceback.
            log.exception("the gateway failed on %s %s", scope.get("method"), scope.get("path"))
            failure = Refusal(
                500, "The gateway failed to answer; its log says why.", kind="api_error", code="internal_error"
            )
            try:
                await self.refuse(send, failure, started, endpoints.dialect_of(scope.get("path", "")))
            except Exception:
                pass  # the answer had begun: uvicorn ends the connection
        finally:
            self.observer.end(exchange)

    async def refuse(self, send, refusal: Refusal, started: float, dialect: str = endpoints.OPENAI) -> None:
        body = refusal.body(dialect)
        headers = [JSON_TYPE, (b"content-length", str(len(body)).encode()), *refusal.headers]
        headers.append(timing(time.perf_counter() - started))
        await send({"type": "http.response.start", "status": refusal.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def health(self, send) -> None:
        """For a load balancer: 503 until the gateway has a table to route by; PostgreSQL away is said, not failed.

        The gateway serves its last table while the database is away (docs/failures.md),
        so a balancer that took it out then would turn an outage of the control plane
        into one of the gateway.
        """
        status, body = verdict("gateway", self.health_checks())
        headers = [JSON_TYPE, (b"content-length", str(len(body)).encode()), (b"cache-control", b"no-store")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def health_checks(self) -> list[Check]:
        def table() -> str:
            if self.table_read_at is None:
                raise RuntimeError("no table read from the database yet")
            return f"{len(self.table.models)} models, read at {iso(self.table_read_at)}"

        def database() -> None:
            if self.stale_since is not None:
                raise RuntimeError(f"the table could not be read since {iso(self.stale_since)}")

        return [
            Check("table", table, without="cannot route a request"),
            Check("database", database, needed=False),
        ]

    async def handle(self, scope, receive, send, started: float) -> None:
        path, method = scope["path"], scope["method"]
        if path == "/v1/models" or path.startswith("/v1/models/"):
            if method not in ("GET", "HEAD"):
                raise Refusal(405, f"{path} answers GET only.", code="method_not_allowed")
            key = await self.authorize(scope)
            await self.list_models(send, key, path[len("/v1/models/") :] if path != "/v1/models" else "", started)
            return
        endpoint = endpoints.ENDPOINTS.get(path)
        if endpoint is None:
            raise Refusal(
                404, f"There is nothing at {path}. The gateway answers {endpoints.listed()}.", code="unknown_url"
            )
        if method != "POST":
            raise Refusal(405, f"{path} answers POST only.", code="method_not_allowed")
        key = await self.authorize(scope)
        # What a key may be refused for before its body is read is checked here (its concurrency,
        # its request and in-flight limits): reading, parsing and translating a large body is the
        # costly part of a request. The model it names is known once the body is parsed.
        flying = self.key_flights.get(key.id, 0)
        if flying >= settings.GATEWAY_KEY_CONCURRENCY:
            raise Refusal(
                429,
                f"This API key has {flying} requests in this gateway process already, as many as it takes from "
                "one key at once (LLMGW_GATEWAY_KEY_CONCURRENCY).",
                kind="rate_limit_error",
                code="rate_limit_exceeded",
                headers=[(b"retry-after", b"1")],
            )
        self.key_flights[key.id] = flying + 1
        try:
            await self.admit_and_route(scope, receive, send, started, key, flying)
        finally:
            self.key_flights[key.id] -= 1
            if not self.key_flights[key.id]:
                del self.key_flights[key.id]

    async def admit_and_route(self, scope, receive, send, started: float, key: routes.Key, flying: int) -> None:
        """A request of a key, let in by its key's limits and its team's budgets (when it has any), read, taken in,
        passed on, and counted against them once answered. `flying`: the key's other requests in this process."""
        ticket = asked = None
        tokens = micro = 0
        try:
            if key.counted:
                # One Redis round trip for a key with limits or a team's budgets, none for a key without
                # (gateway/limits/): the key's and its team's counted in the same script. A small body
                # of a key with token limits is read while its admission is on its way, so that its
                # reservation goes in the same round trip; a large one is read only once admitted. So is
                # one whose key has another request here: that one's settling (its tokens in place of its
                # reservation) may not be queued yet, and a reservation checked before it could overshoot.
                asked = self.limiter.ask(key.tag, key.limits, key.budget)
                if not (reserves(key) and small(scope) and not flying):
                    ticket, asked = await self.limiter.admitted(asked), None
            try:
                body = await read_body(receive, settings.GATEWAY_MAX_BODY)
                if len(body) > PARSE_INLINE_BYTES:
                    # Parsed in a thread, so the event loop's other requests go on between its steps;
                    # intake.MOST_CONTAINERS bounds the steps that hold the interpreter's lock.
                    run = asyncio.get_running_loop().run_in_executor
                    taken = await run(self._parsers, self.take, scope["path"], key, body)
                else:
                    taken = self.take(scope["path"], key, body)
            except Exception:
                if asked is not None:  # the key's own 429 first, as when its body is read after admission
                    ticket, asked = await self.limiter.admitted(asked), None
                raise
            if asked is not None or (ticket is not None and reserves(key)):
                prompt = prompt_estimate(len(taken.body))
                # The most it may cost: its prompt by its size at the input price, all its max_tokens at the output's.
                most = micro_units(cost(taken.route.prices, prompt, taken.output, 0))
                if asked is not None:
                    ticket = await self.limiter.admitted_and_reserved(asked, prompt + taken.output, most)
                else:
                    await self.limiter.reserve(ticket, key.limits, prompt + taken.output, key.budget, most)
            tokens, micro = await self.routed(scope, receive, send, started, key, taken, ticket)
        finally:
            if ticket is not None:
                self.limiter.settle(ticket, tokens, micro)

    def take(self, path: str, key: routes.Key, body: bytes) -> Taken:
        """A body read, taken in by the table of the moment (intake.take); in a thread for a large body."""
        return intake.take(self.table, path, key, body, settings.GATEWAY_ENGINE_KEYS)

    async def routed(
        self, scope, receive, send, started: float, key: routes.Key, taken: Taken, ticket: Ticket | None
    ) -> tuple[int, int]:
        """Pass on a request that is admitted, read and checked; the tokens of its answer, and its cost in
        micro-units. `ticket`: its admission by its key's limits and its team's budgets, if it has any."""
        endpoint, request, route, translation = taken.endpoint, taken.request, taken.route, taken.translation
        self.observer.routed(scope, route.name, request, key.name)
        self.demand.arrived(route.name)
        if not route.upstreams:
            # Refused at once when no replica will come (gateway/hold.py).
            prospect = await self.holding.prospect(route.name)
            if prospect.state == prospects.CANNOT or not settings.HOLD_S:
                raise hold.unavailable(prospect.reason + ".")
        streamed = request.get("stream") is True and route.kind == "chat"
        held = hold.HeldStream(send, endpoint.dialect) if streamed else None
        # From here the request's `receive` is read by its hang-up watcher alone.
        hang_up = HangUp(receive)
        routed = Request(
            scope=scope,
            send=held or send,
            hang_up=hang_up,
            held=held,
            key=key,
            route=route,
            endpoint=endpoint,
            payload=request,
            body=taken.body,
            translation=translation,
            client_wants_usage=taken.client_wants_usage,
            started=started,
            settle=None if ticket is None else functools.partial(self.limiter.settled, ticket),
        )
        try:
            return await self.answer(routed)
        except Refusal as refusal:
            if held is None or not held.started:
                raise
            # The client has a 200 and comments already: the refusal goes in the stream.
            await held.fail(refusal.status, refusal.message, refusal.kind, refusal.code)
            return 0, 0
        finally:
            hang_up.close()

    async def authorize(self, scope) -> routes.Key:
        if self.table_read_at is None:  # no key can be told from another without a table
            raise Refusal(
                503,
                "The gateway has not read its table yet: the database cannot be reached since "
                f"{iso(self.stale_since or time.time())}. It tries again every {self.refresh_s:g} s; try again shortly.",
                kind="api_error",
                code="table_unavailable",
                headers=[(b"retry-after", b"1")],
            )
        given = b""
        for header, value in scope["headers"]:
            if header == b"authorization":
                given = value
                break
            if header == b"x-api-key":  # how Anthropic's clients send it
                given = b"Bearer " + value
        scheme, _, secret = given.decode("latin-1").partition(" ")
        if scheme.lower() != "bearer" or not secret.strip():
            raise Refusal(
                401,
                "No API key: send it as 'Authorization: Bearer <key>' (or 'x-api-key: <key>'). "
                "Staff create keys in the admin or with 'manage.py api_key create NAME'.",
                code="invalid_api_key",
            )
        digest = hash_key(secret.strip())
        key = self.table.keys.get(digest)
        if key is None:
            await self.refresh_since(time.monotonic())  # perhaps a key made a moment ago
            key = self.table.keys.get(digest)
        if key is None:
            raise Refusal(401, "This API key is not valid: it is unknown or was turned off.", code="invalid_api_key")
        if key.expires is not None and key.expires <= time.time():
            when = datetime.fromtimestamp(key.expires, UTC).strftime("%Y-%m-%d %H:%M UTC")
            raise Refusal(401, f"This API key expired at {when}.", code="expired_api_key")
        if key.refused:
            raise Refusal(403, key.refused, kind="permission_error", code="key_owner_not_allowed")
        return key

    async def list_models(self, send, key: routes.Key, one: str, started: float) -> None:
        not_ready = [route.name for route in self.table.models if not route.upstreams and key.may_use(route.name)]
        entries = listing.entries(self.table.models, key.may_use, await self.holding.prospects(not_ready))
        if one:
            found = [entry for entry in entries if entry["id"] == one]
            if not found:
                raise Refusal(404, f"There is no model named {one!r} here.", code="model_not_found")
            payload = found[0]
        else:
            payload = {"object": "list", "data": entries, "table": self.table_state()}
        body = json.dumps(payload).encode()
        headers = [JSON_TYPE, (b"content-length", str(len(body)).encode()), timing(time.perf_counter() - started)]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def iso(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).isoformat(timespec="seconds")
