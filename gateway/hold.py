"""Holding requests for a model that has no ready replica but will have one, instead of refusing them.

When a request finds no replica it can use (none ready, or every ready one refused the
connection), and the model can have one (prospects.py), the request waits here in its
model's queue, first come first served, bounded at LLMGW_HOLD_QUEUE a model. The first
to wait asks the control plane to wake the model (demand.py). The gateway re-reads its
table ten times a second while anyone waits, and the moment the table has a usable
replica every waiting request of that model is let go, in the order they came.

A streamed request is answered 200 with an event stream after a second of waiting and
gets an SSE comment every few seconds (`: waiting for a replica of M: fetching 43%`),
so clients and proxies do not take the silence for a dead connection. From then on its
status is spent: whatever comes later (the replica's error, the gateway's 503) is said
as an error event in the stream's own format, and the stream is ended cleanly
(HeldStream).

A request that waited LLMGW_HOLD_S, or finds its model's queue full, or whose model
turns out unable to wake while it waits, gets a 503 with Retry-After and the reason.
A client that hangs up leaves the queue at once.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from django.db import connection

from contracts import demand as contract

from . import prospects
from .demand import Demand
from .errors import ClientGone, Refusal, error_event, error_of

log = logging.getLogger("llmgw.gateway")

# A streamed request's first comment comes after this long, then one every COMMENT_EVERY_S.
FIRST_COMMENT_S = 1.0
COMMENT_EVERY_S = 3.0
# How often the table is read while requests wait, and their models' prospects.
REFRESH_WHILE_WAITING_S = 0.1
STATUS_EVERY_S = 2.0
# A model's prospect is read at most this often for requests that arrive (and for /v1/models).
PROSPECT_TTL_S = 1.0
RETRY_AFTER = (b"retry-after", b"5")
# Waiting requests are let go one at a time, this far apart: each is on its way to the
# replica (connected, its request written and read) before the next starts, so the
# replica takes them in the order they came. At 2 ms a busy llama.cpp server still took
# some out of order; at 10 ms none (tests/test_hold_real_model.py). The first goes at
# once; 256 waiting requests are all gone within 2.6 s, faster than an engine answers them.
RELEASE_GAP_S = 0.01


def usable(route, cooling: dict[int, float], now: float) -> bool:
    """Whether the route has a replica worth trying: ready, and not just refused a connection."""
    return any(cooling.get(upstream.replica_id, 0.0) <= now for upstream in route.upstreams)


def unavailable(message: str, code: str = "no_ready_replica") -> Refusal:
    return Refusal(503, message, kind="service_unavailable", code=code, headers=[RETRY_AFTER])


# --- a streamed request that waited --------------------------------------------------


class HeldStream:
    """The `send` of a streamed request while and after it waits.

    Before the first comment it passes everything on. After it (the client has a 200
    and an event stream), a replica's event stream goes on without its own start, and
    any other answer (an error, the gateway's refusal) becomes an error event and the
    end of the stream.
    """

    def __init__(self, send, dialect: str) -> None:
        self.send = send
        self.dialect = dialect
        self.started = False
        self._passing = False
        self._status = 0
        self._body = b""

    async def comment(self, text: str) -> None:
        if not self.started:
            self.started = True
            headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
            await self.send(
                {"type": "http.response.start", "status": 200, "headers": [*headers, (b"x-accel-buffering", b"no")]}
            )
        await self.send({"type": "http.response.body", "body": b": " + text.encode() + b"\n\n", "more_body": True})

    async def __call__(self, message) -> None:
        if not self.started:
            await self.send(message)
            return
        if message["type"] == "http.response.start":
            headers = dict(message.get("headers") or [])
            streaming = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            self._passing = message["status"] == 200 and streaming
            self._status = message["status"]
            return
        if self._passing:
            await self.send(message)
            return
        self._body += message.get("body", b"")
        if not message.get("more_body"):
            await self.fail(self._status, *error_of(self._body))

    async def fail(self, status: int, message: str, kind: str = "api_error", code: str | None = None) -> None:
        await self.send({"type": "http.response.body", "body": error_event(self.dialect, status, message, kind, code)})


# --- the queues --------------------------------------------------------------------------


class Waiter:
    __slots__ = ("future", "queued")

    def __init__(self, future: asyncio.Future) -> None:
        self.future = future
        self.queued = True


class Holding:
    """The waiting requests of one gateway process, a FIFO queue per model."""

    def __init__(self, demand: Demand, hold_s: float, size: int, table, per_key: int | None = None) -> None:
        self.demand = demand
        self.table = table  # the gateway's current routing table, when called
        self.hold_s = hold_s
        self.size = size
        self.per_key = per_key or size
        self.queues: dict[str, collections.deque[Waiter]] = {}
        self.by_key: dict[tuple[str, int], int] = {}  # (model, key id): its requests waiting
        self.waiting = 0
        self.status: dict[str, prospects.Prospect] = {}
        self.began_waiting = asyncio.Event()  # the table refresher reads faster from here on
        self._asked: dict[str, float] = {}
        self._cache: dict[str, tuple[float, prospects.Prospect]] = {}
        self._reading = asyncio.Lock()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="gateway-hold")
        self._watcher: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._releasing: set[str] = set()

    # --- what a model can become ------------------------------------------------------

    async def prospects(self, names: list[str]) -> dict[str, prospects.Prospect]:
        """Each model's prospect, read again when older than PROSPECT_TTL_S; one read at a time."""
        routes = self.table().routes
        routed = {name: {u.replica_id for u in routes[name].upstreams} for name in names if name in routes}
        async with self._reading:
            now = time.monotonic()
            stale = [name for name in names if now - self._cache.get(name, (-1e9, None))[0] > PROSPECT_TTL_S]
            if stale:
                fresh = await asyncio.get_running_loop().run_in_executor(self._thread, self._read, stale, routed)
                for name, prospect in fresh.items():
                    self._cache[name] = (now, prospect)
            return {name: self._cache[name][1] for name in names}

    def _read(self, names: list[str], routed: dict[str, set[int]]) -> dict[str, prospects.Prospect]:
        try:
            return prospects.read(names, routed)
        except Exception:
            connection.close()  # the next read connects anew
            raise

    async def prospect(self, name: str) -> prospects.Prospect:
        return (await self.prospects([name]))[name]

    # --- waiting ------------------------------------------------------------------

    async def wait(
        self,
        name: str,
        gone: asyncio.Future,
        stream: HeldStream | None,
        deadline: float,
        prospect,
        also: str = "",
        key_id: int = 0,
    ) -> None:
        """Until the model has a usable replica (release); raises Refusal (503) or ClientGone instead.

        `gone`: done when the client hangs up (the request's HangUp, gateway/request.py).
        """
        queue = self.queues.setdefault(name, collections.deque())
        mine = (name, key_id)
        self._refuse_when_full(queue, mine, prospect)
        waiter = self._join(queue, mine, prospect)
        try:
            await self._until_released(waiter, name, gone, stream, deadline, also)
        finally:
            self._leave(queue, waiter, mine)

    def _refuse_when_full(self, queue: collections.deque[Waiter], mine: tuple[str, int], prospect) -> None:
        """Refuse a request the model's queue, or its key's share of it, has no room for."""
        name = mine[0]
        if len(queue) >= self.size:
            raise unavailable(
                f"{len(queue)} requests are already waiting for a replica of {name}, as many as this gateway "
                f"holds for one model (LLMGW_HOLD_QUEUE); try again shortly. {prospect.reason}.",
                code="hold_queue_full",
            )
        # One key cannot take the whole queue from the others.
        if self.by_key.get(mine, 0) >= self.per_key:
            raise unavailable(
                f"This API key has {self.by_key[mine]} requests waiting for a replica of {name} already, as many "
                f"as one key may have waiting for one model (LLMGW_HOLD_QUEUE_PER_KEY); try again shortly. "
                f"{prospect.reason}.",
                code="hold_queue_full",
            )

    def _join(self, queue: collections.deque[Waiter], mine: tuple[str, int], prospect) -> Waiter:
        """Queue a waiter for the model, counted, and ask for the model to wake if it is the first."""
        name = mine[0]
        self.by_key[mine] = self.by_key.get(mine, 0) + 1
        loop = asyncio.get_running_loop()
        waiter = Waiter(loop.create_future())
        queue.append(waiter)
        self.waiting += 1
        self.demand.wait_changed(name, 1)
        self.status[name] = prospect
        if len(queue) == 1:
            self._wake(name)
        self.began_waiting.set()
        if self._watcher is None or self._watcher.done():
            self._watcher = loop.create_task(self._watch())
        return waiter

    async def _until_released(
        self, waiter: Waiter, name: str, gone: asyncio.Future, stream: HeldStream | None, deadline: float, also: str
    ) -> None:
        """Wait for the waiter's release, commenting on a stream meanwhile; raise at the deadline or a hang-up."""
        next_comment = time.monotonic() + FIRST_COMMENT_S
        while True:
            now = time.monotonic()
            timeout = min(deadline, next_comment) - now if stream is not None else deadline - now
            if timeout > 0:
                await asyncio.wait((waiter.future, gone), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if waiter.future.done():
                waiter.future.result()  # raises the refusal of a model that cannot wake after all
                return
            if gone.done():
                raise ClientGone
            now = time.monotonic()
            if now >= deadline:
                raise unavailable(
                    f"{self.status[name].reason}. Waited {self.hold_s:g} s for one, the longest a request "
                    "waits here (LLMGW_HOLD_S)." + (f" {also}" if also else "")
                )
            if stream is not None and now >= next_comment:
                await stream.comment(f"waiting for a replica of {name}: {self.status[name].status}")
                next_comment = now + COMMENT_EVERY_S

    def _leave(self, queue: collections.deque[Waiter], waiter: Waiter, mine: tuple[str, int]) -> None:
        """Take a waiter that is done out of the queue and the counts, however it ended."""
        name = mine[0]
        if waiter.queued:
            waiter.queued = False
            queue.remove(waiter)
        if not queue and self.queues.get(name) is queue:
            del self.queues[name]
        self.by_key[mine] -= 1
        if not self.by_key[mine]:
            del self.by_key[mine]
        self.waiting -= 1
        self.demand.wait_changed(name, -1)

    def release(self, table, cooling: dict[int, float]) -> None:
        """Let go, in order, every request whose model the table now has a usable replica of."""
        if not self.waiting:
            return
        now = time.monotonic()
        for name in list(self.queues):
            route = table.routes.get(name)
            if route is None or name in self._releasing or not usable(route, cooling, now):
                continue
            self._releasing.add(name)
            # Woken: a request that finds it at zero again (idle, its engine lost) asks again at
            # once, not WAKE_TTL_S after this wake (bench/wake.py waited 30 s for each wake).
            self._asked.pop(name, None)
            for coroutine in (self._let_go_in_order(name, cooling), self.demand.woke(name)):
                task = asyncio.get_running_loop().create_task(coroutine)
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _let_go_in_order(self, name: str, cooling: dict[int, float]) -> None:
        try:
            while queue := self.queues.get(name):
                route = self.table().routes.get(name)
                if route is None or not usable(route, cooling, time.monotonic()):
                    return  # the replica went again: the rest wait for the next
                waiter = queue.popleft()
                waiter.queued = False
                if not waiter.future.done():
                    waiter.future.set_result(None)
                    await asyncio.sleep(RELEASE_GAP_S)
        finally:
            self._releasing.discard(name)

    def _let_go(self, queue: collections.deque[Waiter], refusal: Refusal | None = None) -> None:
        while queue:
            waiter = queue.popleft()
            waiter.queued = False
            if not waiter.future.done():
                if refusal is None:
                    waiter.future.set_result(None)
                else:
                    waiter.future.set_exception(refusal)

    async def _watch(self) -> None:
        """While requests wait: their models' prospects every STATUS_EVERY_S, for comments and refusals."""
        while self.waiting:
            await asyncio.sleep(STATUS_EVERY_S)
            names = list(self.queues)
            if not names:
                continue
            try:
                found = await self.prospects(names)
            except Exception:
                log.exception("the prospects of waiting models could not be read; they keep waiting")
                continue
            for name, prospect in found.items():
                queue = self.queues.get(name)
                if queue is None:
                    continue
                self.status[name] = prospect
                if prospect.state == prospects.CANNOT:
                    self._let_go(queue, unavailable(prospect.reason + "."))
                elif time.monotonic() - self._asked.get(name, -1e9) > contract.WAKE_TTL_S:
                    self._wake(name)  # still waiting: ask again, in case the first was lost

    def _wake(self, name: str) -> None:
        self._asked[name] = time.monotonic()
        task = asyncio.get_running_loop().create_task(self.demand.ask_to_wake(name))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def sleep(self, normal_s: float) -> None:
        """The table refresher's pause: short while requests wait, cut short when one begins to."""
        if self.waiting:
            await asyncio.sleep(min(normal_s, REFRESH_WHILE_WAITING_S))
            return
        self.began_waiting.clear()
        try:
            await asyncio.wait_for(self.began_waiting.wait(), normal_s)
        except TimeoutError:
            pass


def moved(old, new) -> set[int]:
    """Replicas whose address changed between two tables: an engine started again on a new port."""
    if old is new:
        return set()
    before = {u.replica_id: u.base for route in old.models for u in route.upstreams}
    return {u.replica_id for route in new.models for u in route.upstreams if before.get(u.replica_id, u.base) != u.base}
