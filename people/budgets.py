"""A team's budgets and what is left of each now, as /me/ and the API show them.

The minute windows are read live from Redis, where the gateway's limiter counts them (the
counters the limiter keeps for the whole team, gateway.limits.team_used_now); a day and a month are read from the
usage the gateways book (gateway.Usage: tokens and spend per key, model and day), since the
day's and the month's counters of a key without limits of its own are not kept in Redis.
A day and a month are those of LLMGW_BUDGET_TIME_ZONE, as the gateway counts them.
"""

from __future__ import annotations

import logging
import zoneinfo
from dataclasses import dataclass
from datetime import date, datetime
from decimal import Decimal

import redis
from django.conf import settings
from django.db.models import F, Sum
from django.db.models.functions import Coalesce

from accounts.models import Team
from fleet.live import redis_client
from gateway.limits import team_used_now
from gateway.models import Usage

log = logging.getLogger("llmgw.people")


@dataclass(frozen=True)
class Budget:
    name: str  # "tokens per day"
    limit: int | Decimal
    used: int | Decimal | None  # None: not known now (Redis away)

    @property
    def left(self) -> int | Decimal | None:
        return None if self.used is None else max(self.limit - self.used, 0)

    @property
    def percent_used(self) -> int:
        if self.used is None or not self.limit:
            return 0
        return min(100, int(self.used * 100 / self.limit))


def today() -> date:
    zone = zoneinfo.ZoneInfo(getattr(settings, "BUDGET_TIME_ZONE", "UTC") or "UTC")
    return datetime.now(zone).date()


def team_budgets(team: Team) -> list[Budget]:
    """The team's budgets that are set, each with what is used of it now."""
    budgets = []
    minute = {}
    if team.requests_per_minute or team.tokens_per_minute:
        minute = _minute_counts(team)
    if team.requests_per_minute:
        budgets.append(Budget("requests per minute", team.requests_per_minute, minute.get("requests_per_minute")))
    if team.tokens_per_minute:
        budgets.append(Budget("tokens per minute", team.tokens_per_minute, minute.get("tokens_per_minute")))
    if team.tokens_per_day or team.tokens_per_month or team.spend_per_month is not None:
        day = today()
        month = _booked(team, day.replace(day=1))
        if team.tokens_per_day:
            budgets.append(Budget("tokens per day", team.tokens_per_day, _booked(team, day)["tokens"]))
        if team.tokens_per_month:
            budgets.append(Budget("tokens per month", team.tokens_per_month, month["tokens"]))
        if team.spend_per_month is not None:
            budgets.append(Budget("spend per month", team.spend_per_month, month["spend"]))
    return budgets


def _booked(team: Team, since: date) -> dict:
    return booked(Usage.objects.filter(key__team=team), since)


def booked(rows, since: date) -> dict:
    """Tokens and spend of these usage rows since a day: {"tokens": …, "spend": …}."""
    totals = rows.filter(day__gte=since).aggregate(
        tokens=Coalesce(Sum(F("prompt_tokens") + F("completion_tokens")), 0),
        spend=Coalesce(Sum("spend"), Decimal(0)),
    )
    return totals


def _minute_counts(team: Team) -> dict[str, int | None]:
    """The team's requests and tokens this minute, as the gateways' limiter counts them in Redis."""
    try:
        used = team_used_now(redis_client(), team.pk)
    except redis.RedisError as error:
        log.warning("the team's minute windows could not be read from Redis: %s", error)
        return {"requests_per_minute": None, "tokens_per_minute": None}
    return {"requests_per_minute": used["requests_per_minute"], "tokens_per_minute": used["tokens_per_minute"]}
