"""Per-key limits, kept in Redis so that every admin-server process counts against the same numbers.

A key with no limits costs nothing here: the gateway does not call Redis for it.
A key with limits costs one round trip before its request goes on: a Lua script
that reads the key's windows, refuses when one is full, and otherwise counts the
request and marks it in flight, atomically, so two processes cannot both take
the last request of a minute. After the answer, its tokens (from the engine's
usage) are added to the windows and the in-flight mark removed; that write is
sent after the client has its answer, and is not waited for.

Windows are fixed: the minute, the UTC day and the UTC month, each a counter
under its own Redis key that expires after the window. Tokens are known only
after an answer, so a token limit refuses the request after the one that
crossed it: a window can end above its limit by at most one answer per process.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import secrets
import time
from dataclasses import astuple, dataclass, field, fields
from datetime import UTC, datetime

import redis
from django.conf import settings
from redis.connection import parse_url

from .errors import Refusal

log = logging.getLogger("llmgw.gateway")

# In-flight marks older than this are taken for requests whose process died before removing them.
STALE_IN_FLIGHT_S = 3600
# The longest a request waits for Redis before it goes on unchecked.
TIMEOUT_S = 2.0

# KEYS: requests this minute, tokens this minute, tokens today, tokens this month, the in-flight set.
# ARGV: the four limits and the in-flight limit (0: none), now, this request's id, STALE_IN_FLIGHT_S.
# Answers {which limit refused (0: none), requests, tokens minute, day, month, in flight}.
ADMIT = """
local used = {}
for i = 1, 4 do used[i] = tonumber(redis.call('GET', KEYS[i]) or '0') end
local now = tonumber(ARGV[6])
redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now - tonumber(ARGV[8]))
local flying = redis.call('ZCARD', KEYS[5])
for i = 1, 4 do
  local limit = tonumber(ARGV[i])
  if limit > 0 and used[i] >= limit then return {i, used[1], used[2], used[3], used[4], flying} end
end
local most = tonumber(ARGV[5])
if most > 0 and flying >= most then return {5, used[1], used[2], used[3], used[4], flying} end
used[1] = redis.call('INCR', KEYS[1])
if used[1] == 1 then redis.call('EXPIRE', KEYS[1], 120) end
redis.call('ZADD', KEYS[5], now, ARGV[7])
redis.call('EXPIRE', KEYS[5], tonumber(ARGV[8]))
return {0, used[1], used[2], used[3], used[4], flying + 1}
"""

# After the answer. KEYS: tokens this minute, today, this month, the in-flight set.
# ARGV: the answer's tokens, the request's id, and each window's expiry.
SETTLE = """
local tokens = tonumber(ARGV[1])
if tokens > 0 then
  for i = 1, 3 do
    redis.call('INCRBY', KEYS[i], tokens)
    redis.call('EXPIRE', KEYS[i], tonumber(ARGV[i + 2]))
  end
end
return redis.call('ZREM', KEYS[4], ARGV[2])
"""

# Each window's counter outlives its window a little, then goes.
EXPIRES = {"minute": 120, "day": 2 * 86400, "month": 33 * 86400}


def _says(name: str, unit: str):
    return field(default=0, metadata={"says": (name, unit)})


@dataclass(frozen=True)
class Limits:
    """A key's limits, 0 for none, named once: here.

    The order of these fields is the order of ApiKey's limit fields (LIMIT_FIELDS), of
    the ADMIT script's ARGV and KEYS (Windows.keys), and of the number the script answers
    for the limit that refused (1-5, WHAT).
    """

    requests_per_minute: int = _says("requests per minute", "requests")
    tokens_per_minute: int = _says("tokens per minute", "tokens")
    tokens_per_day: int = _says("tokens per day", "tokens")
    tokens_per_month: int = _says("tokens per month", "tokens")
    max_in_flight: int = _says("requests in flight at once", "requests")

    def values(self) -> tuple[int, int, int, int, int]:
        return astuple(self)


LIMIT_FIELDS = tuple(f.name for f in fields(Limits))
# What the script's answer 1-5 names, in a refusal's sentence: (the limit, its unit).
WHAT = {number: f.metadata["says"] for number, f in enumerate(fields(Limits), 1)}


def of(values) -> Limits | None:
    """Limits from the five stored values, or None when there are none to enforce."""
    values = tuple(int(v or 0) for v in values)
    return Limits(*values) if any(values) else None


@dataclass(frozen=True)
class Windows:
    """The Redis keys of one key's windows at one moment, and how long until each resets."""

    keys: tuple[str, str, str, str, str]
    resets: tuple[float, float, float]  # seconds to the next minute, day, month

    @classmethod
    def at(cls, tag: str, now: float) -> Windows:
        moment = datetime.fromtimestamp(now, UTC)
        minute = int(now // 60)
        day = moment.strftime("%Y%m%d")
        month = moment.strftime("%Y%m")
        # The hash tag {tag} keeps a key's counters on one node of a Redis cluster, where a script needs them.
        base = f"llmgw:limit:{{{tag}}}"
        keys = (f"{base}:r:{minute}", f"{base}:t:{minute}", f"{base}:td:{day}", f"{base}:tm:{month}", f"{base}:flight")
        midnight = datetime(moment.year, moment.month, moment.day, tzinfo=UTC).timestamp() + 86400
        next_month = datetime(moment.year + moment.month // 12, moment.month % 12 + 1, 1, tzinfo=UTC).timestamp()
        return cls(keys, ((minute + 1) * 60 - now, midnight - now, next_month - now))


def tag_of(key_hash: str) -> str:
    """The part of a key's hash its counters are filed under: unique enough, and never the key."""
    return key_hash[:16]


@dataclass
class Ticket:
    windows: Windows
    request_id: str


def duration(seconds: float) -> str:
    """OpenAI's spelling of a reset time: 1s, 6m0s, 2h3m4s."""
    whole = max(1, int(seconds + 0.999))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def refusal(limits: Limits, which: int, used: list[int], windows: Windows) -> Refusal:
    """The 429 for the limit `which` (1-5, as the script answers), with OpenAI's x-ratelimit headers."""
    name, unit = WHAT[which]
    limit = limits.values()[which - 1]
    if which == 5:
        retry, sentence = 1.0, f"This API key may have {limit} requests in flight at once, and has {used[5]}."
    else:
        retry = windows.resets[{1: 0, 2: 0, 3: 1, 4: 2}[which]]
        sentence = (
            f"This API key is over its limit of {limit} {name}: {used[which]} {unit} used in this window, "
            f"which resets in {duration(retry)}."
        )
    headers = [(b"retry-after", str(max(1, int(retry + 0.999))).encode())]
    if limits.requests_per_minute:
        headers += [
            (b"x-ratelimit-limit-requests", str(limits.requests_per_minute).encode()),
            (b"x-ratelimit-remaining-requests", str(max(0, limits.requests_per_minute - used[1])).encode()),
            (b"x-ratelimit-reset-requests", duration(windows.resets[0]).encode()),
        ]
    # The token window the headers speak of: the one that refused, else the shortest one set.
    token_window = which - 1 if which in (2, 3, 4) else next((i for i in (1, 2, 3) if limits.values()[i]), None)
    if token_window is not None:
        token_limit = limits.values()[token_window]
        headers += [
            (b"x-ratelimit-limit-tokens", str(token_limit).encode()),
            (b"x-ratelimit-remaining-tokens", str(max(0, token_limit - used[token_window + 1])).encode()),
            (b"x-ratelimit-reset-tokens", duration(windows.resets[max(0, token_window - 1)]).encode()),
        ]
    return Refusal(429, sentence, kind="rate_limit_error", code="rate_limit_exceeded", headers=headers)


class RedisError(Exception):
    """Redis could not be asked, or answered with an error."""


class Pipe(asyncio.Protocol):
    """One connection to Redis, shared by every request of the process, with commands pipelined.

    redis-py's asyncio client spent about 0.7 ms of CPU on each limited request (its
    connection pool, a pure-Python reply parser, a coroutine per command): more than
    the rest of the gateway. Here a command is one write of bytes and its reply, an
    integer or a list of them, is read straight off the socket; replies come back in
    the order commands were sent, so each waiting request is a future in a queue.
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.waiting: collections.deque[asyncio.Future] = collections.deque()
        self.buffer = b""

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.transport = None
        while self.waiting:
            future = self.waiting.popleft()
            if not future.done():
                future.set_exception(RedisError(f"the connection to Redis closed: {exc or 'by Redis'}"))

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while self.waiting:
            parsed = _reply(self.buffer, 0)
            if parsed is None:
                return
            value, at = parsed
            self.buffer = self.buffer[at:]
            future = self.waiting.popleft()
            if not future.done():
                if isinstance(value, RedisError):
                    future.set_exception(value)
                else:
                    future.set_result(value)

    def send(self, *parts) -> asyncio.Future:
        encoded = [p if isinstance(p, bytes) else str(p).encode() for p in parts]
        self.transport.write(b"*%d\r\n" % len(encoded) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in encoded))
        future = asyncio.get_running_loop().create_future()
        self.waiting.append(future)
        return future


def _reply(buffer: bytes, at: int):
    """(value, where it ends) of the RESP reply at `at`, or None when it has not all come yet."""
    end = buffer.find(b"\r\n", at)
    if end < 0:
        return None
    kind, line = buffer[at : at + 1], buffer[at + 1 : end]
    at = end + 2
    if kind == b":":
        return int(line), at
    if kind == b"+":
        return line.decode(), at
    if kind == b"-":
        return RedisError(line.decode(errors="replace")), at
    if kind == b"$":
        size = int(line)
        if size < 0:
            return None, at
        if len(buffer) < at + size + 2:
            return None
        return buffer[at : at + size], at + size + 2
    if kind == b"*":
        items = []
        for _ in range(max(0, int(line))):
            parsed = _reply(buffer, at)
            if parsed is None:
                return None
            item, at = parsed
            items.append(item)
        return items, at
    raise RedisError(f"Redis answered something unexpected: {buffer[at - 2 - len(line) - 1 : at]!r}")


class Limiter:
    """Admits a limited key's requests and counts their tokens; one per gateway process, on its event loop."""

    def __init__(self, url: str | None = None) -> None:
        self._address = parse_url(url or settings.REDIS_URL)
        self._pipe: Pipe | None = None
        self._connecting: asyncio.Future | None = None
        self._shas: dict[str, bytes] = {}
        self._pending: set[asyncio.Task] = set()
        self._warned_at = 0.0

    async def _connection(self) -> Pipe:
        if self._pipe is not None and self._pipe.transport is not None:
            return self._pipe
        if self._connecting is not None:  # another request is connecting: wait for that one
            return await asyncio.shield(self._connecting)
        loop = asyncio.get_running_loop()
        self._connecting = loop.create_future()
        try:
            async with asyncio.timeout(TIMEOUT_S):
                _, pipe = await loop.create_connection(
                    Pipe, self._address.get("host", "127.0.0.1"), self._address.get("port", 6379)
                )
                if self._address.get("password"):
                    auth = [self._address["password"]]
                    if self._address.get("username"):
                        auth.insert(0, self._address["username"])
                    await pipe.send("AUTH", *auth)
                if self._address.get("db"):
                    await pipe.send("SELECT", self._address["db"])
                for script in (ADMIT, SETTLE):
                    self._shas[script] = await pipe.send("SCRIPT", "LOAD", script)
            self._pipe = pipe
            self._connecting.set_result(pipe)
            return pipe
        except BaseException as error:
            failure = error if isinstance(error, RedisError) else RedisError(f"Redis cannot be reached: {error!r}")
            self._connecting.set_exception(failure)
            self._connecting.exception()  # retrieved: nobody else may be waiting
            raise failure from None
        finally:
            self._connecting = None

    async def _run(self, script: str, keys, args):
        pipe = await self._connection()
        async with asyncio.timeout(TIMEOUT_S):
            try:
                return await pipe.send("EVALSHA", self._shas[script], len(keys), *keys, *args)
            except RedisError as error:
                if not str(error).startswith("NOSCRIPT"):  # Redis restarted and forgot it: send it whole
                    raise
                return await pipe.send("EVAL", script, len(keys), *keys, *args)

    async def admit(self, tag: str, limits: Limits) -> Ticket | None:
        """A ticket to go on with, or a 429 Refusal raised. None when Redis could not be asked."""
        now = time.time()
        windows = Windows.at(tag, now)
        request_id = secrets.token_hex(8)
        try:
            answer = await self._run(
                ADMIT,
                windows.keys,
                [*limits.values(), f"{now:.3f}", request_id, STALE_IN_FLIGHT_S],
            )
        except (RedisError, OSError, TimeoutError) as error:
            # Limits are a guard, not the service: with Redis away requests go on, and the log says so.
            self._warn(error)
            return None
        which, *used = answer
        if which:
            raise refusal(limits, which, [0, *used], windows)
        return Ticket(windows, request_id)

    def settle(self, ticket: Ticket, tokens: int) -> None:
        """Count an answer's tokens and end its flight; sent without waiting, the client has its answer."""
        task = asyncio.get_running_loop().create_task(self._settle(ticket, tokens))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _settle(self, ticket: Ticket, tokens: int) -> None:
        keys = ticket.windows.keys
        try:
            await self._run(SETTLE, [*keys[1:4], keys[4]], [tokens, ticket.request_id, *EXPIRES.values()])
        except (RedisError, OSError, TimeoutError) as error:
            self._warn(error)

    def _warn(self, error: Exception) -> None:
        if time.monotonic() - self._warned_at > 60:
            self._warned_at = time.monotonic()
            log.warning("per-key limits are not enforced while Redis cannot be reached: %s", error)

    async def close(self) -> None:
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
        if self._pipe is not None and self._pipe.transport is not None:
            self._pipe.transport.close()
        self._pipe = None


def used_now(client: redis.Redis, key_hash: str) -> dict[str, int]:
    """What a key has used in its current windows, read from Redis: for its admin page. Sync."""
    now = time.time()
    windows = Windows.at(tag_of(key_hash), now)
    pipe = client.pipeline(transaction=False)
    for key in windows.keys[:4]:
        pipe.get(key)
    pipe.zcount(windows.keys[4], now - STALE_IN_FLIGHT_S, "+inf")
    values = [int(v or 0) for v in pipe.execute()]
    return dict(zip(LIMIT_FIELDS, values, strict=True))
