"""What this gateway process sees of demand, shared with the control plane through Redis.

contracts/demand.py is the agreement: each process counts in memory, on its event loop,
the requests in flight per model and per replica, the requests waiting per model and
the time of each model's last request, and writes that as its own field of the hash
LOAD_KEY about once a second. The write is taken on the event loop (a copy of a few
dicts) and sent from a thread of its own, so a request never waits for Redis.

The same round trip appends where this process started new conversations to the stream
CONVERSATIONS_KEY and reads what the others appended (gateway/conversations.py).

It is also how a waiting request asks for its model to wake: SET NX on the model's
wake key, and only when that set the key, the `fleet.wake` task on the control queue.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import redis
from celery import current_app

from contracts import demand
from contracts.tasks import CONTROL_QUEUE
from fleet.live import redis_client

from . import conversations as placements

log = logging.getLogger("llmgw.gateway")

# Fields of processes gone this long are deleted by whichever gateway looks (once a minute).
FORGET_AFTER_S = 600
PRUNE_EVERY_S = 60
# The stream of where conversations started: about this many entries (each a second of one
# process's new conversations) are kept, and a process starting reads the last READ_AT_START
# (five minutes of one process's, a minute of five's: the conversations whose next turn is near).
STREAM_ENTRIES = 10_000
READ_AT_START = 300
# A failure to reach Redis is said in the log at most this often.
WARN_EVERY_S = 60


class Demand:
    """The process's counts and their writer. One per gateway, used on its event loop."""

    def __init__(self, in_flight_by_replica: dict[int, int], conversations: placements.Conversations) -> None:
        self.field = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self.in_flight: dict[str, int] = {}
        self.waiting: dict[str, int] = {}
        self.last_request: dict[str, float] = {}
        # The gateway's own per-replica counts (pick() reads them): not counted twice.
        self.by_replica = in_flight_by_replica
        # Every other gateway process's requests in flight per replica, as of their last writes:
        # what prefix routing's bound adds to this process's own (gateway/prefix.py). Replaced
        # whole from the writer's thread, so the event loop reads one dict or the next.
        self.others: dict[int, int] = {}
        self.conversations = conversations
        self._read_to: bytes | None = None  # the last entry of the conversations' stream read
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="gateway-demand")
        self._writer: asyncio.Task | None = None
        self._writing: asyncio.Future | None = None
        self._soon = asyncio.Event()
        self._pruned_at = 0.0
        self._warned_at = 0.0
        self._client: redis.Redis | None = None

    # --- counting, on the request's path: dict updates only ---------------------------

    def arrived(self, model: str) -> None:
        self.last_request[model] = time.time()

    def started(self, model: str) -> None:
        self.in_flight[model] = self.in_flight.get(model, 0) + 1

    def finished(self, model: str) -> None:
        self.in_flight[model] -= 1

    def wait_changed(self, model: str, by: int) -> None:
        """A request began or ended waiting: the control plane hears of it at once, not in a second."""
        self.waiting[model] = self.waiting.get(model, 0) + by
        self._soon.set()

    def snapshot(self) -> demand.Load:
        models: dict[str, demand.ModelLoad] = {}
        for name, at in self.last_request.items():
            models[name] = {
                "in_flight": self.in_flight.get(name, 0),
                "waiting": self.waiting.get(name, 0),
                "last_request": at,
            }
        replicas = {str(replica): count for replica, count in self.by_replica.items() if count > 0}
        return {"at": time.time(), "models": models, "replicas": replicas}

    # --- writing, beside the requests ------------------------------------------------

    def start(self) -> None:
        if self._writer is None:
            self._writer = asyncio.get_running_loop().create_task(self._write_forever())

    async def stop(self) -> None:
        if self._writer is not None:
            self._writer.cancel()
            self._writer = None
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(loop.run_in_executor(self._thread, self._forget), 3)
        except (TimeoutError, redis.RedisError, OSError):
            pass  # the field goes stale and is ignored, then deleted by another gateway

    async def _write_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                await asyncio.wait_for(self._soon.wait(), demand.LOAD_INTERVAL_S)
            except TimeoutError:
                pass
            self._soon.clear()
            if self._writing is not None and not self._writing.done():
                continue  # Redis is slow: the next snapshot goes when this one is through
            unsent = self.conversations.take_unsent()
            self._writing = loop.run_in_executor(self._thread, self._write, demand.encode(self.snapshot()), unsent)
            self._writing.add_done_callback(self._heard)

    def _heard(self, writing: asyncio.Future) -> None:
        """On the event loop: what the other gateways placed, as the writer read it."""
        if not writing.cancelled() and writing.exception() is None and writing.result():
            self.conversations.heard(writing.result())

    def _redis(self) -> redis.Redis:
        if self._client is None:
            self._client = redis_client()
        return self._client

    def _write(self, encoded: str, unsent: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Write this process's load and new conversations; return the other processes' new conversations."""
        try:
            client = self._redis()
            pipe = client.pipeline(transaction=False)
            pipe.hset(demand.LOAD_KEY, self.field, encoded)
            pipe.hgetall(demand.LOAD_KEY)
            if self._read_to is None:
                pipe.xrevrange(demand.CONVERSATIONS_KEY, count=READ_AT_START)
            else:
                pipe.xread({demand.CONVERSATIONS_KEY: self._read_to}, count=STREAM_ENTRIES)
            if unsent:
                entry = {"from": self.field, "placed": placements.encode(unsent)}
                pipe.xadd(demand.CONVERSATIONS_KEY, entry, maxlen=STREAM_ENTRIES, approximate=True)
            _, fields, read, *_ = pipe.execute()
            now = time.time()
            self.others = self._others(fields, now)
            if now - self._pruned_at > PRUNE_EVERY_S:
                self._pruned_at = now
                self._prune(client, now)
        except (redis.RedisError, OSError) as error:
            self.others = {}  # counts that can no longer be refreshed are not kept as if they were
            self._warn("the gateway's load could not be written to Redis", error)
            return []  # this second's placements are lost to the others: their later turns go by the ring
        entries = list(reversed(read)) if self._read_to is None else [e for _, stream in read for e in stream]
        if entries:
            self._read_to = entries[-1][0]
        elif self._read_to is None:
            self._read_to = b"0-0"
        mine = self.field.encode()
        return [
            placed
            for _, fields in entries
            if fields.get(b"from") != mine
            for placed in placements.decode(fields.get(b"placed", b""))
        ]

    def _others(self, fields: dict, now: float) -> dict[int, int]:
        mine = self.field.encode()
        snapshots = [
            load for field, raw in fields.items() if field != mine and (load := demand.decode(raw)) is not None
        ]
        return demand.total(snapshots, now)[1]

    def _prune(self, client: redis.Redis, now: float) -> None:
        gone = []
        for field, raw in client.hgetall(demand.LOAD_KEY).items():
            load = demand.decode(raw)
            if load is None or now - load["at"] > FORGET_AFTER_S:
                gone.append(field)
        if gone:
            client.hdel(demand.LOAD_KEY, *gone)

    def _forget(self) -> None:
        self._redis().hdel(demand.LOAD_KEY, self.field)

    # --- waking ----------------------------------------------------------------------

    async def ask_to_wake(self, model: str) -> bool:
        """Ask the control plane to wake `model`, unless someone did within WAKE_TTL_S; True if we asked."""
        loop = asyncio.get_running_loop()
        self._soon.set()  # the waiting count goes with it
        return await loop.run_in_executor(self._thread, self._ask_to_wake, model)

    def _ask_to_wake(self, model: str) -> bool:
        try:
            if not self._redis().set(demand.wake_key(model), str(time.time()), nx=True, ex=demand.WAKE_TTL_S):
                return False
            current_app.send_task(demand.WAKE, args=[model], queue=CONTROL_QUEUE)
            log.info("asked the control plane to wake %s: a request is waiting for it", model)
            return True
        except Exception as error:  # Redis or the broker away: the next look asks again
            self._warn(f"the gateway could not ask for {model} to wake", error)
            return False

    async def woke(self, model: str) -> None:
        """`model` has a usable replica: the next request that finds it at zero asks again at once."""
        await asyncio.get_running_loop().run_in_executor(self._thread, self._woke, model)

    def _woke(self, model: str) -> None:
        try:
            self._redis().delete(demand.wake_key(model))
        except Exception as error:  # the key expires on its own (WAKE_TTL_S)
            self._warn(f"the gateway could not clear {model}'s wake", error)

    def _warn(self, what: str, error: Exception) -> None:
        if time.monotonic() - self._warned_at > WARN_EVERY_S:
            self._warned_at = time.monotonic()
            log.warning("%s: %s", what, error)
