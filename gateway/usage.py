"""Usage per key, model and day: journaled locally as answers finish, written to the database in batches.

A database write per request would cost more than the rest of the gateway
together. Each answer appends one line to this process's journal in the spool
directory (LLMGW_GATEWAY_SPOOL): one write() to the page cache, which outlives
the process if it is killed. With each table refresh the database thread closes
the journal as a batch and writes every batch it can lock to the database, in
one transaction that also records the batches' ids (UsageBatch): a batch whose
transaction committed is never added again, whoever tries it next and however
often. While the database is away the batches wait on disk, across restarts of
the gateway; a journal whose process died is taken by the next gateway that
drains the spool.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import threading
import uuid
from datetime import date, datetime, timedelta
from decimal import ROUND_CEILING, Decimal
from pathlib import Path
from zoneinfo import ZoneInfo

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from .endpoints import ENDPOINTS
from .limits import MICRO
from .models import ApiKey, Usage, UsageBatch

log = logging.getLogger("llmgw.gateway")

ZERO = Decimal(0)
USAGE_OBJECT = re.compile(rb'"usage"\s*:\s*\{')
PROMPT_TOKENS = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
# The prompt's tokens the engine took from its cache: OpenAI's usage.prompt_tokens_details.cached_tokens,
# which llama-server writes; its timings' cache_n, where an engine writes only those.
CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
CACHE_N = re.compile(rb'"cache_n"\s*:\s*(\d+)')
# Enough of an answer's end to hold its usage object; kept while the rest streams past.
TAIL_BYTES = 16384
# How far after `"usage": {` the counts may be; usage objects are a few hundred bytes at most.
USAGE_SPAN = 2048


def tokens_in(tail: bytes) -> tuple[int, int] | None:
    """(prompt, completion) from the last usage object in an answer's tail, or None if it has none.

    Works alike on a JSON body and on an event stream, where the usage object
    comes with the last chunk; the engine's counts are taken as they are.
    """
    found = list(USAGE_OBJECT.finditer(tail))
    if not found:
        return None
    last = found[-1]
    span = tail[last.end() : last.end() + USAGE_SPAN]
    prompt, completion = PROMPT_TOKENS.search(span), COMPLETION_TOKENS.search(span)
    if prompt is None and completion is None:
        return None
    return int(prompt.group(1)) if prompt else 0, int(completion.group(1)) if completion else 0


def cached_in(tail: bytes) -> int:
    """The cached prompt tokens of the last usage object in an answer's tail; 0 when it says none."""
    found = list(USAGE_OBJECT.finditer(tail))
    if not found:
        return 0
    span = tail[found[-1].end() : found[-1].end() + USAGE_SPAN]
    counted = CACHED_TOKENS.search(span) or CACHE_N.search(span)
    return int(counted.group(1)) if counted else 0


def cached_shown(usage: dict | None) -> int:
    """The cached prompt tokens of a chat completion's usage, as a translation shows them to its client.

    0 unless the operator shows them (LLMGW_GATEWAY_SHOW_CACHED_TOKENS): the engine's cache is
    shared by every key, and its count tells one key what another sent (docs/gateway.md).
    """
    if not settings.GATEWAY_SHOW_CACHED_TOKENS:
        return 0
    details = (usage or {}).get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if isinstance(cached, int) and cached > 0 else 0


# The end of the last chunk kept to find a match split between two chunks: a match is at most 14 bytes.
CARRY_BYTES = 16
# Characters a token, by OpenAI's rule of thumb, counted in UTF-8 bytes so that a script
# of many bytes a character (CJK: about one token each) is not billed at a quarter.
BYTES_PER_TOKEN = 4


class Answer:
    """What the gateway saw of one answer on its way through: its end, and the text chunks streamed."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.tail = b""
        self.event_stream = False
        self.client_left = False
        self.generated = 0
        self.fed = 0  # bytes of it
        endpoint = ENDPOINTS.get(path)
        self._pattern = endpoint.generated if endpoint else None
        self._carry = b""

    def feed(self, chunk: bytes) -> None:
        self.fed += len(chunk)
        self.tail = (self.tail + chunk)[-TAIL_BYTES:]
        if self.event_stream and self._pattern is not None:
            window = self._carry + chunk
            # A match wholly inside the carry was counted with the chunk before.
            self.generated += len(self._pattern.findall(window)) - len(self._pattern.findall(self._carry))
            self._carry = window[-CARRY_BYTES:]

    def complete(self, length: int | None) -> bool:
        """Whether all of it has come: a stream's [DONE], or the `length` its headers stated."""
        if self.event_stream:
            return self.tail[-64:].rstrip().endswith(b"data: [DONE]")
        return length is not None and self.fed >= length

    def cached(self) -> int:
        """The prompt tokens the engine had in its cache, as it said; 0 when it did not say."""
        return cached_in(self.tail)

    def tokens(self, body_bytes: int) -> tuple[int, int]:
        """(prompt, completion): the engine's own count, or an estimate for an answer cut short.

        The usage comes last and never came (a stream cut short, a client that left before
        a whole answer): the engine's count is gone with the connection, and asking it again
        would cost a request to an engine for each hang-up. The prompt is billed by the size
        of the body the engine was sent (BYTES_PER_TOKEN a token: whatever a client hides in
        tools or formats is read by the engine too), the answer by the text chunks relayed.
        """
        counted = tokens_in(self.tail)
        if counted is not None:
            return counted
        if not (self.event_stream or self.client_left):
            return 0, 0  # an engine's error, whole: nothing was made
        return prompt_estimate(body_bytes), self.generated


def cost(prices, prompt: int, completion: int, cached: int) -> Decimal:
    """What an answer's tokens cost at a model's prices (routes.Route.prices, per million tokens; None: free),
    in micro-units of the prices' currency: a price per million tokens is what one token costs in those."""
    if prices is None:
        return ZERO
    price_input, price_cached, price_output = prices
    cached = min(cached, prompt)
    return (prompt - cached) * price_input + cached * price_cached + completion * price_output


def micro_units(amount: Decimal) -> int:
    """Micro-units counted in Redis, rounded up: a budget is never spent by fractions it does not see."""
    return int(amount.to_integral_value(rounding=ROUND_CEILING))


def prompt_estimate(body_bytes: int) -> int:
    """A prompt's tokens by the size of the body that carries it, rounded up."""
    return -(-body_bytes // BYTES_PER_TOKEN)


# Batches written in one transaction at most: a long outage's backlog goes in a few steps.
BATCHES_AT_ONCE = 500
# Batch ids are kept this long; a batch left on disk longer could be counted a second time.
KEEP_BATCH_IDS = timedelta(days=60)
LIVE_PREFIX, BATCH_SUFFIX = "live-", ".batch"


class Recorder:
    """This process's usage journal. add() is called on the event loop, flush() in the database thread."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._written = 0
        self._failing = False
        self._pruned = False
        self._zone = ZoneInfo(settings.BUDGET_TIME_ZONE)
        self._open_journal()

    def _open_journal(self) -> None:
        # Locked before it has the name other gateways look for, so none takes it for a dead one's.
        self._id = uuid.uuid4().hex
        making = self.directory / f".{self._id}.new"
        self._fd = os.open(making, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        self._path = self.directory / f"{LIVE_PREFIX}{self._id}.log"
        os.rename(making, self._path)
        self._written = 0

    def add(self, key_id: int, model: str, prompt: int, completion: int, cached: int = 0, micro=ZERO) -> None:
        """Journal an answer's tokens and its cost in micro-units (cost()), on the day it ended in the budgets'
        time zone (LLMGW_BUDGET_TIME_ZONE), the day its team's budget counts it in."""
        day = datetime.now(self._zone).date().isoformat()
        line = json.dumps([key_id, model, day, prompt, completion, cached, str(micro)]) + "\n"
        with self._lock:
            try:
                os.write(self._fd, line.encode())
                self._written += 1
            except OSError as error:
                log.error("usage of key %s not recorded: the spool %s cannot be written: %s", key_id, self._path, error)

    def pending(self) -> int:
        """Answers journaled by this process and not yet closed as a batch."""
        with self._lock:
            return self._written

    def close(self) -> None:
        """At shutdown: the journal becomes a batch for whoever drains next."""
        self._rotate()
        os.close(self._fd)

    def _rotate(self) -> None:
        with self._lock:
            if not self._written:
                return
            old_fd, old_path, old_id = self._fd, self._path, self._id
            os.fsync(old_fd)
            os.rename(old_path, self.directory / f"{old_id}{BATCH_SUFFIX}")
            self._open_journal()
        os.close(old_fd)

    def flush(self) -> None:
        """Close the journal as a batch and write the spool's batches. Runs in a thread: it uses the database."""
        self._rotate()
        try:
            taken = last = drain(self.directory)
            while last == BATCHES_AT_ONCE:
                last = drain(self.directory)
                taken += last
            if taken and not self._pruned:
                UsageBatch.objects.filter(written__lt=timezone.now() - KEEP_BATCH_IDS).delete()
                self._pruned = True
        except Exception as error:
            if not self._failing:
                log.warning(
                    "usage is kept in %s until the database can be written again: %s", self.directory, one_line(error)
                )
            self._failing = True
            raise
        if self._failing:
            log.warning("usage kept in %s while the database was away is written", self.directory)
        self._failing = False


def one_line(error: Exception) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def drain(directory: Path) -> int:
    """Write the batches of the spool that no live process holds; the number of batches taken."""
    held: list[tuple[str, Path, int]] = []
    try:
        for path in sorted(directory.iterdir()):
            if len(held) >= BATCHES_AT_ONCE:
                break
            name = path.name
            if name.endswith(BATCH_SUFFIX):
                batch = name[: -len(BATCH_SUFFIX)]
            elif name.startswith(LIVE_PREFIX) and name.endswith(".log"):
                batch = name[len(LIVE_PREFIX) : -len(".log")]  # a journal whose process died, if unlocked
            else:
                continue
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            if os.fstat(fd).st_nlink == 0:  # written and removed by another gateway meanwhile
                os.close(fd)
                continue
            held.append((batch, path, fd))
        if not held:
            return 0
        counts: dict[tuple[int, str, date], list[int]] = {}
        contents = {}
        for batch, _, fd in held:
            with os.fdopen(os.dup(fd), "rb") as fh:
                contents[batch] = fh.read()
        with transaction.atomic():
            done = set(UsageBatch.objects.filter(id__in=list(contents)).values_list("id", flat=True))
            for batch, data in contents.items():
                if batch not in done:
                    _add_lines(counts, data)
            UsageBatch.objects.bulk_create([UsageBatch(id=batch) for batch in contents if batch not in done])
            _write(counts)
        for _, path, _ in held:
            path.unlink(missing_ok=True)
        return len(held)
    finally:
        for _, _, fd in held:
            os.close(fd)


def _add_lines(counts: dict, data: bytes) -> None:
    for line in data.splitlines():
        try:
            # A journal written before spend was counted has five fields a line.
            key_id, model, day, prompt, completion, *rest = json.loads(line)
            cached, micro = (int(rest[0]), Decimal(rest[1])) if rest else (0, ZERO)
        except (ValueError, ArithmeticError, TypeError, IndexError):
            continue  # a line cut short by a machine that lost power: its answer is lost, not the batch
        where = (int(key_id), str(model), date.fromisoformat(day))
        mine = counts.setdefault(where, [0, 0, 0, 0, ZERO])
        mine[0] += 1
        mine[1] += int(prompt)
        mine[2] += int(completion)
        mine[3] += cached
        mine[4] += micro


def _write(counts: dict) -> None:
    if not counts:
        return
    # A key deleted since its requests were counted takes its usage with it.
    live = set(ApiKey.objects.filter(pk__in={k for k, _, _ in counts}).values_list("pk", flat=True))
    for (key_id, model, day), (requests, prompt, completion, cached, micro) in counts.items():
        if key_id not in live:
            continue
        row, _ = Usage.objects.get_or_create(key_id=key_id, model_name=model, day=day)
        Usage.objects.filter(pk=row.pk).update(
            requests=F("requests") + requests,
            prompt_tokens=F("prompt_tokens") + prompt,
            completion_tokens=F("completion_tokens") + completion,
            cached_tokens=F("cached_tokens") + cached,
            spend=F("spend") + micro / MICRO,
        )
    ApiKey.objects.filter(pk__in=live).update(last_used=timezone.now())
