"""Per-key limits, kept in Redis so that every gateway process, on every host, counts against the same numbers.

A key with no limits costs nothing here: the gateway does not call Redis for it.
A key with limits waits for one reply before its request goes on: a Lua script
that reads the key's windows, refuses when one is full, and otherwise counts the
request and marks it in flight, atomically, so two processes cannot both take
the last request of a minute. After the answer, its tokens (from the engine's
usage) are added to the windows and the in-flight mark removed; that write is
sent after the client has its answer, and is not waited for. The requests of one
turn of the event loop share those scripts (one admission and one settling a key,
see Limiter), which is what makes a limited request cost little more than one
without limits.

Windows are fixed: the minute, the UTC day and the UTC month, each a counter
under its own Redis key that expires after the window.

Admission comes in two steps, so that a request the key may not make costs
nothing. Before its body is read, ADMIT counts the request and marks it in
flight (and refuses a key whose token windows are full already). Once the body
is read, a key with token limits has RESERVE add to its token windows what the
request may cost at most: its prompt by the body's size and the most tokens its
answer may have (the max_tokens the gateway sends, intake.check_limits), refused
when that does not fit. For a small body the two go in one round trip: the body
is read while ADMIT is on its way and RESERVE is queued in the same batch, holding
nothing for a request not in flight (one ADMIT refused). Settling replaces the
reservation with the answer's tokens. So concurrent requests cannot together go past a token window: each
holds its share of it while it runs.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import logging
import secrets
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import astuple, dataclass, field, fields
from datetime import datetime, timedelta, tzinfo
from decimal import Decimal
from zoneinfo import ZoneInfo

import hiredis
import redis
from django.conf import settings
from redis.connection import parse_url

from .errors import Refusal

log = logging.getLogger("llmgw.gateway")

# In-flight marks older than this are taken for requests whose process died before removing them.
STALE_IN_FLIGHT_S = 3600
# How long Redis may stay silent before the requests waiting on it go on unchecked (at most twice this).
TIMEOUT_S = 2.0

# The counters the scripts are given, as KEYS: a key's requests this minute (1), tokens this minute (2),
# today (3) and this month (4), its in-flight set (5); for a key of a team, also the team's requests this
# minute (6), tokens this minute (7), today (8), this month (9), and money this month in micro-units (10).
# A limit's number in a refusal is its counter's number here (WHAT, TEAM_WHAT).

# Admits the requests of one key that came in one turn of a gateway's event loop, in order.
# ARGV: how many KEYS (5, or 10 with a team), each counter's limit (0: none; the 5th is the in-flight
# limit), now, STALE_IN_FLIGHT_S, then each request's id. Answers 1 + KEYS numbers a request: which
# limit refused it (0: none), then each counter (the 5th: the requests in flight).
ADMIT = """
local n = tonumber(ARGV[1])
local used = {}
for i = 1, n do
  if i ~= 5 then used[i] = tonumber(redis.call('GET', KEYS[i]) or '0') end
end
local now = tonumber(ARGV[n + 2])
local stale = tonumber(ARGV[n + 3])
redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now - stale)
used[5] = redis.call('ZCARD', KEYS[5])
local answers, marks, admitted = {}, {}, 0
for r = n + 4, #ARGV do
  local which = 0
  for i = 1, n do
    local limit = tonumber(ARGV[i + 1])
    if limit > 0 and used[i] >= limit then which = i break end
  end
  if which == 0 then
    admitted = admitted + 1
    used[1] = used[1] + 1
    used[5] = used[5] + 1
    if n > 5 then used[6] = used[6] + 1 end
    marks[#marks + 1] = now
    marks[#marks + 1] = ARGV[r]
  end
  local a = #answers
  answers[a + 1] = which
  for i = 1, n do answers[a + 1 + i] = used[i] end
end
if admitted > 0 then
  if redis.call('INCRBY', KEYS[1], admitted) == admitted then redis.call('EXPIRE', KEYS[1], 120) end
  if n > 5 and redis.call('INCRBY', KEYS[6], admitted) == admitted then redis.call('EXPIRE', KEYS[6], 120) end
  redis.call('ZADD', KEYS[5], unpack(marks))
  redis.call('EXPIRE', KEYS[5], stale)
end
return answers
"""

# Which window each counter of tokens or money is (1: minute, 2: day, 3: month), for its expiry.
WINDOW_OF = "local window = {[2] = 1, [3] = 2, [4] = 3, [7] = 1, [8] = 2, [9] = 3, [10] = 3}"

# After the answers of one key. KEYS: as ADMIT's. ARGV: the answers' tokens together less what they
# had reserved (below 0 when they reserved more), their money likewise, each window's expiry (set when
# its counter is made), then each request's id.
SETTLE = (
    WINDOW_OF
    + """
local deltas = {tonumber(ARGV[1]), tonumber(ARGV[2])}
for _, i in ipairs({2, 3, 4, 7, 8, 9, 10}) do
  local delta = deltas[i == 10 and 2 or 1]
  if i <= #KEYS and delta ~= 0 then
    local expiry = tonumber(ARGV[2 + window[i]])
    if redis.call('INCRBY', KEYS[i], delta) == delta then redis.call('EXPIRE', KEYS[i], expiry) end
  end
end
return redis.call('ZREM', KEYS[5], unpack(ARGV, 6))
"""
)

# Reserves the most each request of one key may cost in its windows of tokens (and its team's money),
# in the order they came. KEYS: as ADMIT's. ARGV: how many KEYS, each counter's limit as ADMIT has them,
# each window's expiry, then each request's id, tokens and money. Answers 1 + KEYS numbers a request:
# which counter refused it (0: none; -1: it is not in flight, so ADMIT refused it and nothing is held),
# then each counter, with what is reserved. The check on the flight is what lets a small request's
# RESERVE go in the same batch as its ADMIT, before ADMIT has answered: one round trip, not two.
RESERVE = (
    WINDOW_OF
    + """
local n = tonumber(ARGV[1])
local counters = {2, 3, 4}
if n > 5 then counters = {2, 3, 4, 7, 8, 9, 10} end
local used = {}
for i = 1, n do used[i] = 0 end
for _, i in ipairs(counters) do used[i] = tonumber(redis.call('GET', KEYS[i]) or '0') end
local added = {}
for _, i in ipairs(counters) do added[i] = 0 end
local answers = {}
for r = n + 5, #ARGV, 3 do
  local amount = {tonumber(ARGV[r + 1]), tonumber(ARGV[r + 2])}
  local which = 0
  if not redis.call('ZSCORE', KEYS[5], ARGV[r]) then which = -1 end
  for _, i in ipairs(counters) do
    if which ~= 0 then break end
    local limit = tonumber(ARGV[i + 1])
    if limit > 0 and used[i] + amount[i == 10 and 2 or 1] > limit then which = i break end
  end
  if which == 0 then
    for _, i in ipairs(counters) do
      local want = amount[i == 10 and 2 or 1]
      used[i] = used[i] + want
      added[i] = added[i] + want
    end
  end
  local a = #answers
  answers[a + 1] = which
  for i = 1, n do answers[a + 1 + i] = used[i] end
end
for _, i in ipairs(counters) do
  if added[i] > 0 and redis.call('INCRBY', KEYS[i], added[i]) == added[i] then
    redis.call('EXPIRE', KEYS[i], tonumber(ARGV[n + 1 + window[i]]))
  end
end
return answers
"""
)

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

    @property
    def tokens(self) -> tuple[int, int, int]:
        return self.values()[1:4]


LIMIT_FIELDS = tuple(f.name for f in fields(Limits))
# What the script's answer 1-5 names, in a refusal's sentence: (the limit, its unit).
WHAT = {number: f.metadata["says"] for number, f in enumerate(fields(Limits), 1)}


def of(values) -> Limits | None:
    """Limits from the five stored values, or None when there are none to enforce."""
    values = tuple(int(v or 0) for v in values)
    return Limits(*values) if any(values) else None


# Money is counted in Redis in millionths of the prices' currency: a price per million tokens is then
# the micro-units one token costs, and an integer counter holds any spend exactly enough.
MICRO = 1_000_000


@dataclass(frozen=True)
class Budget:
    """A team's budgets, shared by every key of the team, 0 for none. In the order of the scripts'
    counters 6-10 (see ADMIT); spend in micro-units of the prices' currency."""

    requests_per_minute: int = _says("requests per minute", "requests")
    tokens_per_minute: int = _says("tokens per minute", "tokens")
    tokens_per_day: int = _says("tokens per day", "tokens")
    tokens_per_month: int = _says("tokens per month", "tokens")
    spend_per_month: int = _says("spend per month", "")
    team: str = field(default="", compare=True)  # its name, for refusals
    tag: str = ""  # what its counters are filed under

    def values(self) -> tuple[int, int, int, int, int]:
        return astuple(self)[:5]


BUDGET_FIELDS = tuple(f.name for f in fields(Budget))[:5]
TEAM_WHAT = {number: f.metadata["says"] for number, f in enumerate(fields(Budget)[:5], 6)}


def budget_of(team_id: int, name: str, values) -> Budget | None:
    """A team's budgets from its stored values (spend a Decimal in the currency), None when it has none."""
    *counts, spend = values
    numbers = (*(int(v or 0) for v in counts), int((spend or 0) * MICRO))
    return Budget(*numbers, team=name, tag=f"team{team_id}") if any(numbers) else None


def zone() -> ZoneInfo:
    return ZoneInfo(settings.BUDGET_TIME_ZONE)


def calendar(now: float, where: tzinfo) -> tuple[str, str, float, float]:
    """The day and the month `now` falls in, in the time zone `where` (as YYYYMMDD and YYYYMM), and the
    Unix times they end: a calendar day and month of that zone, 23 or 25 hours long on a change of clocks."""
    moment = datetime.fromtimestamp(now, where)
    tomorrow = moment.date() + timedelta(days=1)
    day_end = datetime(tomorrow.year, tomorrow.month, tomorrow.day, tzinfo=where).timestamp()
    month_end = datetime(moment.year + moment.month // 12, moment.month % 12 + 1, 1, tzinfo=where).timestamp()
    return moment.strftime("%Y%m%d"), moment.strftime("%Y%m"), day_end, month_end


@dataclass(frozen=True, eq=False)  # eq=False: told apart by identity, a cheap key for a batch
class Windows:
    """The Redis keys of one key's windows at one moment (and its team's), and when each window ends."""

    keys: tuple[str, ...]  # 5, or 10 for a key of a team: the scripts' KEYS
    ends: tuple[float, float, float]  # the Unix times the minute, the day and the month end

    @property
    def minute_start(self) -> float:
        return self.ends[0] - 60

    def resets(self, now: float | None = None) -> tuple[float, float, float]:
        """Seconds until the minute, the day and the month reset."""
        now = time.time() if now is None else now
        return tuple(end - now for end in self.ends)

    @classmethod
    def at(cls, tag: str, now: float, team: str = "", where: tzinfo | None = None) -> Windows:
        day, month, day_end, month_end = calendar(now, where or zone())
        minute = int(now // 60)
        # The hash tag {...} keeps the counters one script reads on one node of a Redis cluster: a key's
        # own, or for a key of a team, the team's and those of all its keys.
        base = f"llmgw:limit:{{{team}}}:{tag}" if team else f"llmgw:limit:{{{tag}}}"
        keys = (f"{base}:r:{minute}", f"{base}:t:{minute}", f"{base}:td:{day}", f"{base}:tm:{month}", f"{base}:flight")
        if team:
            shared = f"llmgw:team:{{{team}}}"
            keys += (
                f"{shared}:r:{minute}",
                f"{shared}:t:{minute}",
                f"{shared}:td:{day}",
                f"{shared}:tm:{month}",
                f"{shared}:sm:{month}",
            )
        return cls(keys, ((minute + 1) * 60, day_end, month_end))


def tag_of(key_hash: str) -> str:
    """The part of a key's hash its counters are filed under: unique enough, and never the key."""
    return key_hash[:16]


@dataclass
class Ticket:
    windows: Windows
    request_id: str
    reserved: int = 0  # tokens held in its windows until it settles
    reserved_money: int = 0  # micro-units held in its team's spend


@dataclass
class Asked:
    """An admission queued (Limiter.ask) and not yet answered: its ticket if it is admitted."""

    ticket: Ticket
    limits: Limits
    budget: Budget | None
    answer: asyncio.Future = field(init=False)


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


def money(micro: int) -> str:
    """Micro-units of the prices' currency as an amount: 12.5, 0.000125."""
    text = f"{Decimal(micro) / MICRO:f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def team_refusal(budget: Budget, which: int, used: list[int], windows: Windows, wanted: tuple[int, int]) -> Refusal:
    """The 429 for the team's budget `which` (6-10, as the scripts answer)."""
    name, unit = TEAM_WHAT[which]
    limit = budget.values()[which - 6]
    retry = windows.resets()[{6: 0, 7: 0, 8: 1, 9: 2, 10: 2}[which]]
    at = datetime.fromtimestamp(time.time() + retry, zone()).strftime("%Y-%m-%d %H:%M %Z")
    when = f"it resets in {duration(retry)} (at {at})"
    if which == 10:
        spent = f"{money(used[which])} spent or reserved this month"
        sentence = f"The team {budget.team} is over its monthly spend budget of {money(limit)}: {spent}"
        if wanted[1]:
            sentence += f", and this request may cost {money(wanted[1])} (its prompt by its size, and its max_tokens)"
    else:
        sentence = f"The team {budget.team} is over its budget of {limit} {name}: {used[which]} {unit} used"
        if which in (7, 8, 9) and wanted[0]:
            sentence += (
                f" or reserved, and this request may use {wanted[0]} (its prompt by its size, and its max_tokens)"
            )
    sentence += f"; {when}."
    headers = [(b"retry-after", str(max(1, int(retry + 0.999))).encode())]
    return Refusal(429, sentence, kind="rate_limit_error", code="rate_limit_exceeded", headers=headers)


def refusal(limits: Limits, which: int, used: list[int], windows: Windows, wanted: int = 0) -> Refusal:
    """The 429 for the limit `which` (1-5, as the scripts answer), with OpenAI's x-ratelimit headers.

    `wanted`: the tokens a request would have reserved (RESERVE), when that is what did not fit.
    """
    name, unit = WHAT[which]
    limit = limits.values()[which - 1]
    resets = windows.resets()
    if which == 5:
        retry, sentence = 1.0, f"This API key may have {limit} requests in flight at once, and has {used[5]}."
    else:
        retry = resets[{1: 0, 2: 0, 3: 1, 4: 2}[which]]
        if wanted:
            beyond = " more than the whole window" if wanted > limit else ""
            sentence = (
                f"This API key is over its limit of {limit} {name}: {used[which]} {unit} used or reserved in this "
                f"window, and this request may use {wanted}{beyond} (its prompt by its size, and its max_tokens); "
                f"the window resets in {duration(retry)}."
            )
        else:
            sentence = (
                f"This API key is over its limit of {limit} {name}: {used[which]} {unit} used in this window, "
                f"which resets in {duration(retry)}."
            )
    headers = [(b"retry-after", str(max(1, int(retry + 0.999))).encode())]
    if limits.requests_per_minute:
        headers += [
            (b"x-ratelimit-limit-requests", str(limits.requests_per_minute).encode()),
            (b"x-ratelimit-remaining-requests", str(max(0, limits.requests_per_minute - used[1])).encode()),
            (b"x-ratelimit-reset-requests", duration(resets[0]).encode()),
        ]
    # The token window the headers speak of: the one that refused, else the shortest one set.
    token_window = which - 1 if which in (2, 3, 4) else next((i for i in (1, 2, 3) if limits.values()[i]), None)
    if token_window is not None:
        token_limit = limits.values()[token_window]
        headers += [
            (b"x-ratelimit-limit-tokens", str(token_limit).encode()),
            (b"x-ratelimit-remaining-tokens", str(max(0, token_limit - used[token_window + 1])).encode()),
            (b"x-ratelimit-reset-tokens", duration(resets[max(0, token_window - 1)]).encode()),
        ]
    return Refusal(429, sentence, kind="rate_limit_error", code="rate_limit_exceeded", headers=headers)


def _ssl_context(address: dict) -> ssl.SSLContext | None:
    """rediss://'s TLS as redis-py reads its query: ssl_cert_reqs (none|optional|required) and ssl_ca_certs."""
    if "ssl_cert_reqs" not in address and "ssl_ca_certs" not in address:
        cls = address.get("connection_class")
        if cls is None or "SSL" not in cls.__name__:
            return None
    context = ssl.create_default_context(cafile=address.get("ssl_ca_certs"))
    reqs = address.get("ssl_cert_reqs", "required")
    if reqs in ("none", ssl.CERT_NONE):
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    elif reqs in ("optional", ssl.CERT_OPTIONAL):
        context.check_hostname = False
        context.verify_mode = ssl.CERT_OPTIONAL
    return context


class RedisError(Exception):
    """Redis could not be asked, or answered with an error."""


class Pipe(asyncio.Protocol):
    """One connection to Redis, shared by every request of the process.

    What a limited request paid here was mostly system calls: a write for its admission,
    a write for its settling, a read for each reply. So commands are not written when
    made but gathered, and written together once a turn of the event loop (`flush`);
    Redis answers them in one go, and hiredis (the C parser redis-py uses) reads the
    replies, which come back in the order the commands were sent: each one's callback
    waits in a queue. A reply overdue by TIMEOUT_S cuts the connection, and every
    command waiting on it fails, so no request waits on a Redis that went silent.
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.reader = hiredis.Reader(replyError=RedisError)
        self.waiting: collections.deque[Callable[[object], None]] = collections.deque()
        self.outgoing: list[bytes] = []
        self._loop = asyncio.get_running_loop()
        self._flush_soon = False
        self._replies = 0  # replies read so far, for the watchdog
        self._watchdog: asyncio.TimerHandle | None = None
        self._idle: asyncio.Future | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.transport = None
        self.outgoing.clear()
        failure = RedisError(f"the connection to Redis closed: {exc or 'by Redis'}")
        while self.waiting:
            self.waiting.popleft()(failure)
        self._went_idle()

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        while self.waiting:
            reply = self.reader.gets()
            if reply is False:
                break
            self._replies += 1
            self.waiting.popleft()(reply)
        if not self.waiting:
            self._went_idle()

    def send(self, command: bytes, then: Callable[[object], None]) -> None:
        """Write `command` (packed) with the next flush; `then` gets its reply, or a RedisError."""
        if self.transport is None:
            then(RedisError("the connection to Redis closed"))
            return
        self.outgoing.append(command)
        self.waiting.append(then)
        if not self._flush_soon:
            self._flush_soon = True
            self._loop.call_soon(self.flush)
        if self._watchdog is None:
            self._watchdog = self._loop.call_later(TIMEOUT_S, self._check, self._replies)

    def ask(self, *parts) -> asyncio.Future:
        """`send`, for a caller that awaits the reply."""
        future = self._loop.create_future()
        self.send(hiredis.pack_command(parts), lambda reply: _resolve(future, reply))
        return future

    def flush(self) -> None:
        self._flush_soon = False
        if self.outgoing and self.transport is not None:
            self.transport.write(b"".join(self.outgoing))
            self.outgoing.clear()

    def _check(self, replies_then: int) -> None:
        self._watchdog = None
        if not self.waiting:
            return
        if self._replies == replies_then and self.transport is not None:
            log.warning("Redis did not answer within %g s: the connection is closed and opened again", TIMEOUT_S)
            self.transport.abort()  # connection_lost fails everything waiting
            return
        self._watchdog = self._loop.call_later(TIMEOUT_S, self._check, self._replies)

    def _went_idle(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self._idle is not None and not self._idle.done():
            self._idle.set_result(None)

    async def idle(self) -> None:
        """Until every command sent has its reply."""
        if self.waiting:
            self._idle = self._loop.create_future()
            await self._idle


def _retrieved(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()  # looked at, so asyncio does not log it as never retrieved


def _resolve(future: asyncio.Future, reply) -> None:
    if future.done():
        return
    if isinstance(reply, Exception):
        future.set_exception(reply)
    else:
        future.set_result(reply)


class Limiter:
    """Admits a limited key's requests and counts their tokens; one per gateway process, on its event loop.

    What one turn of the event loop asked is sent to Redis together: for each key, one
    script settles the answers that ended (their tokens added up, their flights ended),
    one admits the requests that came and one reserves the tokens of those whose bodies
    were read, each in the order they came. Each script runs
    atomically in Redis, so the counts are exact across processes and hosts however the
    requests are batched: a batch of five with four left in the minute admits four.
    """

    def __init__(self, url: str | None = None) -> None:
        self._address = parse_url(url or settings.REDIS_URL)
        self._ssl = _ssl_context(self._address)
        self._pipe: Pipe | None = None
        self._connecting: asyncio.Task | None = None
        self._shas: dict[str, bytes] = {}
        # Waiting for the next send: admissions by key and limits, settlings by key.
        self._admitting: dict[tuple[Windows, Limits, Budget | None], list[tuple[str, asyncio.Future]]] = {}
        self._settling: dict[Windows, list] = {}
        self._reserving: dict[tuple[Windows, Limits, Budget | None], list[tuple[str, int, int, asyncio.Future]]] = {}
        self._send_soon = False
        self._windows: dict[tuple[str, str], Windows] = {}
        self._ids = itertools.count()
        self._id_prefix = secrets.token_hex(4)
        self._warned_at = 0.0
        self._zone = zone()

    # --- the two calls --------------------------------------------------------------------

    async def admit(self, tag: str, limits: Limits | None, budget: Budget | None = None) -> Ticket | None:
        """A ticket to go on with, or a 429 Refusal raised. None when Redis could not be asked.

        `budget`: the key's team's, counted in the same script as the key's own limits.
        """
        return await self.admitted(self.ask(tag, limits, budget))

    def ask(self, tag: str, limits: Limits | None, budget: Budget | None = None) -> Asked:
        """Queue the admission admit() makes, for the next batch, without waiting for it: admitted() waits."""
        limits = limits or NO_LIMITS
        windows = self.windows(tag, time.time(), budget.tag if budget else "")
        asked = Asked(Ticket(windows, f"{self._id_prefix}{next(self._ids):x}"), limits, budget)
        asked.answer = asyncio.get_running_loop().create_future()
        self._admitting.setdefault((windows, limits, budget), []).append((asked.ticket.request_id, asked.answer))
        self._send_later()
        return asked

    async def admitted(self, asked: Asked) -> Ticket | None:
        """The ticket of an admission asked for, or its 429 raised; None when Redis could not be asked."""
        try:
            which, *used = await asked.answer
        except (RedisError, OSError, TimeoutError) as error:
            # Limits are a guard, not the service: with Redis away requests go on, and the log says so.
            self._warn(error)
            return None
        if which:
            raise _refused(asked.limits, asked.budget, which, [0, *used], asked.ticket.windows, (0, 0))
        return asked.ticket

    async def reserve(
        self, ticket: Ticket, limits: Limits | None, tokens: int, budget: Budget | None = None, micro: int = 0
    ) -> None:
        """Hold `tokens` in the key's (and its team's) token windows, and `micro` in its team's spend, until the
        ticket settles; or raise the 429 (and end its flight).

        Unchecked (nothing reserved) when Redis cannot be asked, as admit() is.
        """
        answer = self.ask_to_reserve(ticket, limits, tokens, budget, micro)
        await self.reserved(ticket, answer, limits, tokens, budget, micro)

    def ask_to_reserve(
        self, ticket: Ticket, limits: Limits | None, tokens: int, budget: Budget | None = None, micro: int = 0
    ) -> asyncio.Future:
        """Queue reserve()'s script for the next batch; it may go before the ticket's admission has answered
        (RESERVE holds nothing for a request ADMIT refused)."""
        answer = asyncio.get_running_loop().create_future()
        key = (ticket.windows, limits or NO_LIMITS, budget)
        self._reserving.setdefault(key, []).append((ticket.request_id, tokens, micro, answer))
        self._send_later()
        return answer

    async def reserved(
        self,
        ticket: Ticket,
        answer: asyncio.Future,
        limits: Limits | None,
        tokens: int,
        budget: Budget | None = None,
        micro: int = 0,
    ) -> None:
        """Wait for a reservation asked for: held, or its 429 raised (and its flight ended)."""
        try:
            which, *used = await answer
        except (RedisError, OSError, TimeoutError) as error:
            self._warn(error)
            return
        if which < 0:
            return  # not in flight: its admission was refused, or its mark went stale; nothing is held
        if which:
            self.settle(ticket, 0)
            raise _refused(limits or NO_LIMITS, budget, which, [0, *used], ticket.windows, (tokens, micro))
        ticket.reserved, ticket.reserved_money = tokens, micro

    def admitted_and_reserved(self, asked: Asked, tokens: int, micro: int = 0) -> Awaitable[Ticket | None]:
        """admitted() and reserve() in one round trip: the reservation is queued now, before the admission has
        answered, so both scripts go in the same batch; what is returned waits for both."""
        answer = self.ask_to_reserve(asked.ticket, asked.limits, tokens, asked.budget, micro)
        return self._admitted_and_reserved(asked, answer, tokens, micro)

    async def _admitted_and_reserved(
        self, asked: Asked, answer: asyncio.Future, tokens: int, micro: int
    ) -> Ticket | None:
        ticket = await self.admitted(asked)
        if ticket is None:
            answer.add_done_callback(_retrieved)  # Redis failed both: said once, by admitted()
            return None
        await self.reserved(ticket, answer, asked.limits, tokens, asked.budget, micro)
        return ticket

    def settle(self, ticket: Ticket, tokens: int, micro: int = 0) -> None:
        """Count an answer's tokens (and its cost, in micro-units) in place of its reservation and end its flight;
        sent with the next batch."""
        batch = self._settling.get(ticket.windows)
        if batch is None:
            batch = self._settling[ticket.windows] = [0, 0]
        batch[0] += tokens - ticket.reserved
        batch[1] += micro - ticket.reserved_money
        ticket.reserved = ticket.reserved_money = 0
        batch.append(ticket.request_id)
        self._send_later()

    def windows(self, tag: str, now: float, team: str = "") -> Windows:
        """The key's windows at `now`: worked out once a minute, not for every request."""
        windows = self._windows.get((tag, team))
        if windows is None or not windows.minute_start <= now < windows.ends[0]:
            windows = self._windows[(tag, team)] = Windows.at(tag, now, team, self._zone)
        return windows

    # --- sending --------------------------------------------------------------------------

    def _send_later(self) -> None:
        if not self._send_soon:
            self._send_soon = True
            asyncio.get_running_loop().call_soon(self._send)

    def _send(self) -> None:
        self._send_soon = False
        if self._connecting is not None:
            return  # sent once connected
        if self._pipe is None or self._pipe.transport is None:
            self._connecting = asyncio.get_running_loop().create_task(self._connect_and_send())
            return
        pipe = self._pipe
        settling, self._settling = self._settling, {}
        admitting, self._admitting = self._admitting, {}
        # Settlings first: a flight that ended makes room for a request in this same batch.
        for windows, (tokens, micro, *ids) in settling.items():
            for some in _chunks(ids):
                self._call(pipe, SETTLE, windows.keys, (tokens, micro, *EXPIRES.values(), *some), self._settled)
                tokens = micro = 0
        now = f"{time.time():.3f}"
        for (windows, limits, budget), requests in admitting.items():
            counted = _counted(windows, limits, budget)
            for some in _chunks(requests):
                ids = [request_id for request_id, _ in some]
                futures = [future for _, future in some]
                args = (*counted, now, STALE_IN_FLIGHT_S, *ids)
                self._call(pipe, ADMIT, windows.keys, args, functools.partial(_admitted, futures, counted[0] + 1))
        reserving, self._reserving = self._reserving, {}
        for (windows, limits, budget), requests in reserving.items():
            counted = _counted(windows, limits, budget)
            for some in _chunks(requests):
                amounts = [part for request_id, tokens, micro, _ in some for part in (request_id, tokens, micro)]
                futures = [future for *_, future in some]
                args = (*counted, *EXPIRES.values(), *amounts)
                self._call(pipe, RESERVE, windows.keys, args, functools.partial(_admitted, futures, counted[0] + 1))
        pipe.flush()  # written now, not a turn of the loop later

    def _call(self, pipe: Pipe, script: str, keys, args, then: Callable[[object], None]) -> None:
        def answered(reply) -> None:
            if isinstance(reply, RedisError) and str(reply).startswith("NOSCRIPT"):
                # Redis forgot the script (SCRIPT FLUSH) with the connection open: sent whole, once.
                pipe.send(hiredis.pack_command(("EVAL", script, len(keys), *keys, *args)), then)
            else:
                then(reply)

        pipe.send(hiredis.pack_command(("EVALSHA", self._shas[script], len(keys), *keys, *args)), answered)

    def _settled(self, reply) -> None:
        if isinstance(reply, Exception):
            self._warn(reply)

    async def _connect_and_send(self) -> None:
        try:
            self._pipe = await self._connect()
        except (RedisError, OSError, TimeoutError) as error:
            failure = error if isinstance(error, RedisError) else RedisError(f"Redis cannot be reached: {error!r}")
            for requests in (*self._admitting.values(), *self._reserving.values()):
                for *_, future in requests:
                    _resolve(future, failure)
            self._admitting.clear()
            self._reserving.clear()
            if self._settling:
                self._settling.clear()
                self._warn(failure)
            return
        finally:
            self._connecting = None
        self._send()

    async def _connect(self) -> Pipe:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(TIMEOUT_S):
            try:
                if "path" in self._address:  # unix://
                    transport, pipe = await loop.create_unix_connection(Pipe, self._address["path"])
                else:  # redis:// or rediss:// (ssl is None for the first)
                    host = self._address.get("host", "127.0.0.1")
                    transport, pipe = await loop.create_connection(
                        Pipe, host, self._address.get("port", 6379), ssl=self._ssl, server_hostname=self._ssl and host
                    )
            except OSError as error:
                raise RedisError(f"Redis cannot be reached: {error!r}") from None
            try:
                if self._address.get("password"):
                    auth = [self._address["password"]]
                    if self._address.get("username"):
                        auth.insert(0, self._address["username"])
                    await pipe.ask("AUTH", *auth)
                if self._address.get("db"):
                    await pipe.ask("SELECT", self._address["db"])
                for script in (ADMIT, RESERVE, SETTLE):
                    self._shas[script] = await pipe.ask("SCRIPT", "LOAD", script)
            except BaseException:
                transport.close()
                raise
        return pipe

    def _warn(self, error: Exception) -> None:
        if time.monotonic() - self._warned_at > 60:
            self._warned_at = time.monotonic()
            log.warning("per-key limits are not enforced while Redis cannot be reached: %s", error)

    async def close(self) -> None:
        """Send what is waiting and wait for its replies (a while at most), then close."""
        if self._connecting is not None:
            await asyncio.gather(self._connecting, return_exceptions=True)
        if self._settling or self._admitting or self._reserving:
            self._send()
            if self._connecting is not None:
                await asyncio.gather(self._connecting, return_exceptions=True)
        if self._pipe is not None and self._pipe.transport is not None:
            self._pipe.flush()
            try:
                async with asyncio.timeout(TIMEOUT_S):
                    await self._pipe.idle()
            except TimeoutError:
                pass
            if self._pipe.transport is not None:
                self._pipe.transport.close()
        self._pipe = None


NO_LIMITS = Limits()


def _counted(windows: Windows, limits: Limits, budget: Budget | None) -> tuple[int, ...]:
    """The scripts' first ARGV: how many counters, then each one's limit."""
    if len(windows.keys) == 5:
        return (5, *limits.values())
    return (10, *limits.values(), *(budget or Budget()).values())


def _refused(limits: Limits, budget: Budget | None, which: int, used, windows: Windows, wanted) -> Refusal:
    if which >= 6:
        return team_refusal(budget, which, used, windows, wanted)
    return refusal(limits, which, used, windows, wanted=wanted[0])


# Requests (or flights) one script is given at most: Lua's unpack() stops at a few thousand.
BATCH = 200


def _chunks(items: list) -> list[list]:
    return [items] if len(items) <= BATCH else [items[i : i + BATCH] for i in range(0, len(items), BATCH)]


def _admitted(futures: list[asyncio.Future], size: int, reply) -> None:
    """Hand each request of a batch its `size` numbers of the ADMIT (or RESERVE) script's answer."""
    if isinstance(reply, Exception):
        for future in futures:
            _resolve(future, reply)
        return
    for i, future in enumerate(futures):
        _resolve(future, reply[size * i : size * i + size])


def used_now(client: redis.Redis, key_hash: str, team_id: int | None = None) -> dict[str, int]:
    """What a key has used in its current windows, read from Redis: for its admin page. Sync."""
    now = time.time()
    windows = Windows.at(tag_of(key_hash), now, f"team{team_id}" if team_id else "")
    pipe = client.pipeline(transaction=False)
    for key in windows.keys[:4]:
        pipe.get(key)
    pipe.zcount(windows.keys[4], now - STALE_IN_FLIGHT_S, "+inf")
    values = [int(v or 0) for v in pipe.execute()]
    return dict(zip(LIMIT_FIELDS, values, strict=True))


def team_used_now(client: redis.Redis, team_id: int) -> dict[str, int]:
    """What a team's keys have used together in its current windows, read from Redis: for /me/. Sync.

    The team's counters exist while it has a budget (a key of a team without one counts only its own).
    """
    windows = Windows.at("", time.time(), f"team{team_id}")
    names = ("requests_per_minute", "tokens_per_minute", "tokens_per_day", "tokens_per_month", "spend_per_month")
    return dict(zip(names, (int(v or 0) for v in client.mget(windows.keys[5:])), strict=True))
