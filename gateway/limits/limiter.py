"""The limiter: what one turn of the event loop asked of Redis, sent together, and each request's answer."""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import hiredis
from django.conf import settings
from redis.connection import parse_url

from .connection import TIMEOUT_S, Pipe, RedisError, connect, resolve, retrieved, ssl_context
from .refusals import refused
from .scripts import ADMIT, BATCH, EXPIRES, RESERVE, SETTLE, STALE_IN_FLIGHT_S
from .windows import Budget, Limits, Windows, zone

log = logging.getLogger("llmgw.gateway")


@dataclass
class Ticket:
    windows: Windows
    request_id: str
    reserved: int = 0  # tokens held in its windows until it settles
    reserved_money: int = 0  # micro-units held in its team's spend
    # Answers it went on without (a fast admission, a reservation taken as held): it settles after them, so
    # that its flight ends after it began and what replaces its reservation is what Redis holds.
    unanswered: list[asyncio.Future] = field(default_factory=list)
    settled: bool = False  # its answer counted: settle() counts it once
    heard: Heard | None = None  # what the process knows of its key's counters (Limiter.settled judges by it)


@dataclass
class Asked:
    """An admission queued (Limiter.ask) and not yet answered: its ticket if it is admitted."""

    ticket: Ticket
    limits: Limits
    budget: Budget | None
    answer: asyncio.Future = field(init=False)
    fast: bool = False  # let go without waiting for the answer: the key is far below its limits


# How old the last answer about a key may be for a request to go on without waiting for its own.
FAST_AGE_S = 1.0
# How long what no request waits for may wait to be sent with something else.
LAZY_S = 0.002
# The counters (1-based, as the scripts number them) that count requests; 10 counts money; the rest tokens.
REQUEST_COUNTERS = frozenset((1, 5, 6))
MONEY_COUNTER = 10


@dataclass
class Heard:
    """What this process last heard of one key's counters (in its windows, under its limits), and what it has
    asked of them since without an answer yet: together, the most the counters can hold as far as it knows."""

    limits: tuple[int, ...]  # the key's limits and its team's budgets, as the scripts number their counters
    used: tuple[int, ...] = ()  # each counter, as the last answer said; () before the first
    at: float = 0.0  # when that answer came (monotonic)
    asked: int = 0  # admissions on their way
    tokens: int = 0  # tokens of reservations on their way
    micro: int = 0  # and their money

    def far_below(self, share: float, requests: int, tokens: int, micro: int) -> bool:
        """Whether one more request (`requests`), or reservation (`tokens`, `micro`), keeps every counter under
        `share` of its limit, counting everything on its way; never on an answer older than FAST_AGE_S."""
        if not self.used or time.monotonic() - self.at > FAST_AGE_S:
            return False
        for number, (limit, used) in enumerate(zip(self.limits, self.used, strict=True), 1):
            if not limit:
                continue
            if number in REQUEST_COUNTERS:
                more = self.asked + requests
            elif number == MONEY_COUNTER:
                more = self.micro + micro
            else:
                more = self.tokens + tokens
            if used + more > limit * share:
                return False
        return True


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
        self._ssl = ssl_context(self._address)
        self._pipe: Pipe | None = None
        self._connecting: asyncio.Task | None = None
        self._shas: dict[str, bytes] = {}
        # Waiting for the next send: admissions by key and limits, settlings by key.
        self._admitting: dict[tuple[Windows, Limits, Budget | None], list[tuple[str, asyncio.Future]]] = {}
        self._settling: dict[Windows, list] = {}
        self._reserving: dict[tuple[Windows, Limits, Budget | None], list[tuple[str, int, int, asyncio.Future]]] = {}
        self._send_soon = False
        self._lazy: asyncio.TimerHandle | None = None
        self._windows: dict[tuple[str, str], Windows] = {}
        self._ids = itertools.count()
        self._id_prefix = secrets.token_hex(4)
        self._warned_at = 0.0
        self._zone = zone()
        self._heard: dict[tuple[Windows, Limits, Budget | None], Heard] = {}
        self._deferring: set[asyncio.Future] = set()  # answers that settlings wait for (Ticket.unanswered)
        self._fast_share = settings.LIMITS_FAST_SHARE

    # --- the two calls --------------------------------------------------------------------

    async def admit(self, tag: str, limits: Limits | None, budget: Budget | None = None) -> Ticket | None:
        """A ticket to go on with, or a 429 Refusal raised. None when Redis could not be asked.

        `budget`: the key's team's, counted in the same script as the key's own limits.
        """
        return await self.admitted(self.ask(tag, limits, budget))

    def ask(self, tag: str, limits: Limits | None, budget: Budget | None = None) -> Asked:
        """Queue the admission admit() makes, for the next batch, without waiting for it: admitted() waits,
        unless the key is far below its limits (`Asked.fast`)."""
        limits = limits or NO_LIMITS
        windows = self.windows(tag, time.time(), budget.tag if budget else "")
        asked = Asked(Ticket(windows, f"{self._id_prefix}{next(self._ids):x}"), limits, budget)
        asked.answer = asyncio.get_running_loop().create_future()
        key = (windows, limits, budget)
        asked.fast = self._judge_and_count(key, asked.answer, 1, 0, 0)
        asked.ticket.heard = self._heard[key]
        self._admitting.setdefault(key, []).append((asked.ticket.request_id, asked.answer))
        self._send_later(urgent=not asked.fast)
        return asked

    async def admitted(self, asked: Asked) -> Ticket | None:
        """The ticket of an admission asked for, or its 429 raised; None when Redis could not be asked.

        A fast one (`Asked.fast`) has its ticket at once: its answer still comes, counted in the
        key's windows all the same, and is what the key's next requests are judged by.
        """
        if asked.fast:
            asked.ticket.unanswered.append(asked.answer)
            return asked.ticket
        try:
            which, *used = await asked.answer
        except (RedisError, OSError, TimeoutError) as error:
            # Limits are a guard, not the service: with Redis away requests go on, and the log says so.
            self._warn(error)
            return None
        if which:
            raise refused(asked.limits, asked.budget, which, [0, *used], asked.ticket.windows, (0, 0))
        return asked.ticket

    async def reserve(
        self, ticket: Ticket, limits: Limits | None, tokens: int, budget: Budget | None = None, micro: int = 0
    ) -> None:
        """Hold `tokens` in the key's (and its team's) token windows, and `micro` in its team's spend, until the
        ticket settles; or raise the 429 (and end its flight).

        Unchecked (nothing reserved) when Redis cannot be asked, as admit() is.
        """
        answer, fast = self.ask_to_reserve(ticket, limits, tokens, budget, micro)
        if fast:
            self._take_as_held(ticket, answer, tokens, micro)
        else:
            await self.reserved(ticket, answer, limits, tokens, budget, micro)

    def ask_to_reserve(
        self, ticket: Ticket, limits: Limits | None, tokens: int, budget: Budget | None = None, micro: int = 0
    ) -> tuple[asyncio.Future, bool]:
        """Queue reserve()'s script for the next batch; it may go before the ticket's admission has answered
        (RESERVE holds nothing for a request ADMIT refused). Its answer to come, and whether the key is far
        enough below its limits for the reservation to be taken as held without waiting for it."""
        answer = asyncio.get_running_loop().create_future()
        key = (ticket.windows, limits or NO_LIMITS, budget)
        fast = self._judge_and_count(key, answer, 0, tokens, micro)
        self._reserving.setdefault(key, []).append((ticket.request_id, tokens, micro, answer))
        self._send_later(urgent=not fast)
        return answer, fast

    def _judge_and_count(self, key: tuple, answer: asyncio.Future, requests: int, tokens: int, micro: int) -> bool:
        """Whether the key is far enough below its limits for this admission (`requests`) or reservation
        (`tokens`, `micro`) to go on without its answer; judged first, then counted as on its way until
        the answer comes (`_hear`)."""
        heard = self._heard.get(key)
        if heard is None:
            heard = self._heard[key] = Heard(_counted(*key)[1:])
        fast = self._fast_share > 0 and heard.far_below(self._fast_share, requests, tokens, micro)
        heard.asked += requests
        heard.tokens += tokens
        heard.micro += micro
        answer.add_done_callback(functools.partial(self._hear, heard, requests, tokens, micro))
        return fast

    def _take_as_held(self, ticket: Ticket, answer: asyncio.Future, tokens: int, micro: int) -> None:
        """A reservation taken as held without waiting for its answer: the ticket holds it, and the answer,
        when it comes, says whether Redis did."""
        ticket.reserved, ticket.reserved_money = tokens, micro
        ticket.unanswered.append(answer)
        answer.add_done_callback(functools.partial(_reservation_answered, ticket))

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
            raise refused(limits or NO_LIMITS, budget, which, [0, *used], ticket.windows, (tokens, micro))
        ticket.reserved, ticket.reserved_money = tokens, micro

    def admitted_and_reserved(self, asked: Asked, tokens: int, micro: int = 0) -> Awaitable[Ticket | None]:
        """admitted() and reserve() in one round trip: the reservation is queued now, before the admission has
        answered, so both scripts go in the same batch; what is returned waits for both."""
        answer, fast = self.ask_to_reserve(asked.ticket, asked.limits, tokens, asked.budget, micro)
        return self._admitted_and_reserved(asked, answer, fast, tokens, micro)

    async def _admitted_and_reserved(
        self, asked: Asked, answer: asyncio.Future, fast: bool, tokens: int, micro: int
    ) -> Ticket | None:
        ticket = await self.admitted(asked)
        if ticket is None:
            answer.add_done_callback(retrieved)  # Redis failed both: said once, by admitted()
            return None
        if fast:
            self._take_as_held(ticket, answer, tokens, micro)
        else:
            await self.reserved(ticket, answer, asked.limits, tokens, asked.budget, micro)
        return ticket

    async def settled(self, ticket: Ticket, tokens: int, micro: int = 0) -> None:
        """settle(), awaited before the client has the last of its answer (gateway/relay.py), so that a next
        request it sends after it, to this process or another, is judged with it counted.

        Where that could matter (the key, with what this answer adds to its reservation, no longer far
        below a limit: Heard.far_below), it waits for the answers its request went on without (a fast one
        settles only after them; at most TIMEOUT_S, after which the connection is cut and they fail), then
        sends its settling at once and lets the loop write it before the client's last byte: settle()
        alone would send it within LAZY_S, behind the client's back, and a next request through another
        gateway process could reach Redis first. Far below, nothing waits, as the request did not: a next
        request judged before this settling is judged on counters short of it while they are under half
        of every limit.
        """
        heard = ticket.heard
        delta_tokens, delta_micro = tokens - ticket.reserved, micro - ticket.reserved_money
        if (
            self._fast_share > 0
            and heard is not None
            and heard.far_below(self._fast_share, 0, delta_tokens, delta_micro)
        ):
            self.settle(ticket, tokens, micro)
            return
        waiting = [answer for answer in ticket.unanswered if not answer.done()]
        if waiting:
            self._send_later(urgent=True)  # its admission may wait for a lazy batch
            await asyncio.wait(waiting)
        self.settle(ticket, tokens, micro)
        self._send_later(urgent=True)
        await asyncio.sleep(0)  # the batch is sent (Limiter._send) before this goes on

    def settle(self, ticket: Ticket, tokens: int, micro: int = 0) -> None:
        """Count an answer's tokens (and its cost, in micro-units) in place of its reservation and end its flight,
        once however often it is called; sent with the next batch."""
        if not ticket.settled:
            ticket.settled = True
            self._settle(ticket, tokens, micro)

    def _settle(self, ticket: Ticket, tokens: int, micro: int) -> None:
        waiting = [answer for answer in ticket.unanswered if not answer.done()]
        if waiting:
            self._deferring.add(waiting[0])
            waiting[0].add_done_callback(self._deferring.discard)
            waiting[0].add_done_callback(lambda _: self._settle(ticket, tokens, micro))
            return
        batch = self._settling.get(ticket.windows)
        if batch is None:
            batch = self._settling[ticket.windows] = [0, 0]
        batch[0] += tokens - ticket.reserved
        batch[1] += micro - ticket.reserved_money
        ticket.reserved = ticket.reserved_money = 0
        batch.append(ticket.request_id)
        self._send_later(urgent=False)

    def windows(self, tag: str, now: float, team: str = "") -> Windows:
        """The key's windows at `now`: worked out once a minute, not for every request."""
        windows = self._windows.get((tag, team))
        if windows is None or not windows.minute_start <= now < windows.ends[0]:
            if windows is not None:
                # What was heard of the last minute's counters says nothing of this one's.
                for key in [key for key in self._heard if key[0] is windows]:
                    del self._heard[key]
            windows = self._windows[(tag, team)] = Windows.at(tag, now, team, self._zone)
        return windows

    # --- sending --------------------------------------------------------------------------

    def _send_later(self, urgent: bool = True) -> None:
        """The next batch sent at the end of this turn of the loop when a request waits for it (`urgent`), else
        within LAZY_S: what no request waits for (settlings, fast admissions) goes with the next that does,
        or with others like it, rather than waking Redis and this loop once a request (bench/gateway.py)."""
        loop = asyncio.get_running_loop()
        if urgent:
            if not self._send_soon:
                self._send_soon = True
                loop.call_soon(self._send)
        elif not self._send_soon and self._lazy is None:
            self._lazy = loop.call_later(LAZY_S, self._send)

    def _send(self) -> None:
        self._send_soon = False
        if self._lazy is not None:
            self._lazy.cancel()
            self._lazy = None
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
            self._pipe, self._shas = await connect(self._address, self._ssl, (ADMIT, RESERVE, SETTLE))
        except (RedisError, OSError, TimeoutError) as error:
            failure = error if isinstance(error, RedisError) else RedisError(f"Redis cannot be reached: {error!r}")
            for requests in (*self._admitting.values(), *self._reserving.values()):
                for *_, future in requests:
                    resolve(future, failure)
            self._admitting.clear()
            self._reserving.clear()
            if self._settling:
                self._settling.clear()
                self._warn(failure)
            return
        finally:
            self._connecting = None
        self._send()

    def _hear(self, heard: Heard, asked: int, tokens: int, micro: int, answer: asyncio.Future) -> None:
        """An answer about a key's counters came (or failed): no longer on its way; what it says, kept."""
        heard.asked -= asked
        heard.tokens -= tokens
        heard.micro -= micro
        if answer.cancelled():
            return
        if (error := answer.exception()) is not None:
            # Retrieved, and said: a request that went on without this answer (a fast one) went on unchecked.
            self._warn(error)
            return
        which, *used = answer.result()
        if which >= 0:  # -1: a RESERVE for a request not in flight, which says nothing of the counters
            heard.used, heard.at = tuple(used), time.monotonic()

    def _warn(self, error: Exception) -> None:
        if time.monotonic() - self._warned_at > 60:
            self._warned_at = time.monotonic()
            log.warning("per-key limits are not enforced while Redis cannot be reached: %s", error)

    async def close(self) -> None:
        """Send what is waiting and wait for its replies (a while at most), then close."""
        if self._connecting is not None:
            await asyncio.gather(self._connecting, return_exceptions=True)
        if self._deferring:
            # Settlings waiting for an answer: queued once it comes (a while at most).
            await asyncio.wait(set(self._deferring), timeout=TIMEOUT_S)
            await asyncio.sleep(0)
        if self._settling or self._admitting or self._reserving:
            self._send()
            if self._connecting is not None:
                await asyncio.gather(self._connecting, return_exceptions=True)
        if self._pipe is not None and self._pipe.transport is not None:
            await self._pipe.close()
        self._pipe = None


NO_LIMITS = Limits()


def _counted(windows: Windows, limits: Limits, budget: Budget | None) -> tuple[int, ...]:
    """The scripts' first ARGV: how many counters, then each one's limit."""
    if len(windows.keys) == 5:
        return (5, *limits.values())
    return (10, *limits.values(), *(budget or Budget()).values())


def _chunks(items: list) -> list[list]:
    return [items] if len(items) <= BATCH else [items[i : i + BATCH] for i in range(0, len(items), BATCH)]


def _reservation_answered(ticket: Ticket, answer: asyncio.Future) -> None:
    """A reservation taken as held: what Redis did. Refused, or not asked, it holds nothing, and the ticket neither."""
    if answer.cancelled() or answer.exception() is not None or answer.result()[0] != 0:
        ticket.reserved = ticket.reserved_money = 0


def _admitted(futures: list[asyncio.Future], size: int, reply) -> None:
    """Hand each request of a batch its `size` numbers of the ADMIT (or RESERVE) script's answer."""
    if isinstance(reply, Exception):
        for future in futures:
            resolve(future, reply)
        return
    for i, future in enumerate(futures):
        resolve(future, reply[size * i : size * i + size])
