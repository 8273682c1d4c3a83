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
import logging
import secrets
import time
from dataclasses import dataclass
from datetime import UTC, datetime

import redis
import redis.asyncio
from django.conf import settings

from .errors import Refusal

log = logging.getLogger("llmgw.gateway")

# In-flight marks older than this are taken for requests whose process died before removing them.
STALE_IN_FLIGHT_S = 3600

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

WHAT = {
    1: ("requests per minute", "requests"),
    2: ("tokens per minute", "tokens"),
    3: ("tokens per day", "tokens"),
    4: ("tokens per month", "tokens"),
    5: ("requests in flight at once", "requests"),
}
# Each window's counter outlives its window a little, then goes.
EXPIRES = {"minute": 120, "day": 2 * 86400, "month": 33 * 86400}


@dataclass(frozen=True)
class Limits:
    """A key's limits, 0 for none: the order of gateway.models.LIMIT_FIELDS."""

    requests_per_minute: int = 0
    tokens_per_minute: int = 0
    tokens_per_day: int = 0
    tokens_per_month: int = 0
    in_flight: int = 0

    def values(self) -> tuple[int, int, int, int, int]:
        return (
            self.requests_per_minute,
            self.tokens_per_minute,
            self.tokens_per_day,
            self.tokens_per_month,
            self.in_flight,
        )


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


class Limiter:
    """Admits a limited key's requests and counts their tokens; one per gateway process, on its event loop."""

    def __init__(self, url: str | None = None) -> None:
        self._url = url or settings.REDIS_URL
        self._client: redis.asyncio.Redis | None = None
        self._admit = None
        self._pending: set[asyncio.Task] = set()
        self._warned_at = 0.0

    def _connect(self):
        if self._client is None:
            self._client = redis.asyncio.Redis.from_url(self._url, socket_timeout=2, socket_connect_timeout=2)
            self._admit = self._client.register_script(ADMIT)
        return self._admit

    async def admit(self, tag: str, limits: Limits) -> Ticket | None:
        """A ticket to go on with, or a 429 Refusal raised. None when Redis could not be asked."""
        now = time.time()
        windows = Windows.at(tag, now)
        request_id = secrets.token_hex(8)
        try:
            answer = await self._connect()(
                keys=list(windows.keys),
                args=[*limits.values()[:4], limits.in_flight, f"{now:.3f}", request_id, STALE_IN_FLIGHT_S],
            )
        except redis.RedisError as error:
            # Limits are a guard, not the service: with Redis away requests go on, and the log says so.
            self._warn(error)
            return None
        which, *used = (int(v) for v in answer)
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
            async with self._client.pipeline(transaction=True) as pipe:
                if tokens > 0:
                    for key, expires in zip(keys[1:4], EXPIRES.values(), strict=True):
                        pipe.incrby(key, tokens)
                        pipe.expire(key, expires)
                pipe.zrem(keys[4], ticket.request_id)
                await pipe.execute()
        except redis.RedisError as error:
            self._warn(error)

    def _warn(self, error: Exception) -> None:
        if time.monotonic() - self._warned_at > 60:
            self._warned_at = time.monotonic()
            log.warning("per-key limits are not enforced while Redis cannot be reached: %s", error)

    async def close(self) -> None:
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def used_now(client: redis.Redis, key_hash: str) -> dict[str, int]:
    """What a key has used in its current windows, read from Redis: for its admin page. Sync."""
    now = time.time()
    windows = Windows.at(tag_of(key_hash), now)
    pipe = client.pipeline(transaction=False)
    for key in windows.keys[:4]:
        pipe.get(key)
    pipe.zcount(windows.keys[4], now - STALE_IN_FLIGHT_S, "+inf")
    values = [int(v or 0) for v in pipe.execute()]
    names = ("requests_per_minute", "tokens_per_minute", "tokens_per_day", "tokens_per_month", "max_in_flight")
    return dict(zip(names, values, strict=True))
