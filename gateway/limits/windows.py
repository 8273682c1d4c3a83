"""A key's limits and its team's budgets, named once, and the windows they are counted in: the minute, the day and
the month, each a counter under its own Redis key; and what a key or a team has used in them, read for its pages.
"""

from __future__ import annotations

import time
from dataclasses import astuple, dataclass, field, fields
from datetime import datetime, timedelta, tzinfo
from zoneinfo import ZoneInfo

import redis
from django.conf import settings

from .scripts import STALE_IN_FLIGHT_S


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
