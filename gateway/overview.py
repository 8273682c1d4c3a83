"""Requests and tokens per model for the admin's front page: the last 24 hours and the last 30 days.

The 30 days are the usage rows (per key, model and day), added up by the
database in one grouped query. The 24 hours are the hourly counts the gateway
keeps in Redis (gateway.metrics), since the rows only know days. Charts of five
hundred models would show nothing: the busiest few are drawn, the rest as one.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from django.db.models import Sum
from django.utils import timezone

from fleet.live import redis_client

from .metrics import HOUR_PREFIX
from .models import Usage

MODELS_DRAWN = 8
OTHERS = "other models"


def last_30_days() -> dict:
    """Three grouped reads whatever the number of models: which are the busiest, their days, and every day's total."""
    today = timezone.localdate()
    days = [today - timedelta(days=n) for n in range(29, -1, -1)]
    recent = Usage.objects.filter(day__gte=days[0]).order_by()
    tokens = Sum("prompt_tokens") + Sum("completion_tokens")
    busiest = list(
        recent.values("model_name")
        .annotate(t=tokens, r=Sum("requests"))
        .order_by("-t", "-r", "model_name")
        .values_list("model_name", flat=True)[: MODELS_DRAWN + 1]
    )
    drawn = busiest if len(busiest) <= MODELS_DRAWN else busiest[:MODELS_DRAWN]
    cells: dict[tuple[str, str], tuple[int, int]] = {}
    for day, model, requests, used in (
        recent.filter(model_name__in=drawn).values_list("day", "model_name").annotate(r=Sum("requests"), t=tokens)
    ):
        cells[(day.isoformat(), model)] = (requests, used)
    if len(busiest) > MODELS_DRAWN:
        for day, requests, used in recent.values_list("day").annotate(r=Sum("requests"), t=tokens):
            mine = [cells.get((day.isoformat(), model), (0, 0)) for model in drawn]
            cells[(day.isoformat(), OTHERS)] = (requests - sum(r for r, _ in mine), used - sum(t for _, t in mine))
    return chart([d.isoformat() for d in days], [d.strftime("%b %d") for d in days], cells, order=drawn)


def last_24_hours() -> dict:
    now = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    hours = [now - timedelta(hours=n) for n in range(23, -1, -1)]
    keys = [h.strftime("%Y%m%d%H") for h in hours]
    cells: dict[tuple[str, str], tuple[int, int]] = {}
    try:
        pipe = redis_client().pipeline(transaction=False)
        for key in keys:
            pipe.hgetall(HOUR_PREFIX + key)
        answers = pipe.execute()
    except Exception:
        answers = [{}] * len(keys)  # Redis away: an empty chart, not a broken page
    # Prompt tokens and those of them the engines had cached, per model: the prompt cache's hit rate.
    prompts: dict[str, list[int]] = {}
    for key, counts in zip(keys, answers, strict=True):
        by_model: dict[str, list[int]] = {}
        for field, value in counts.items():
            model, _, what = (field.decode() if isinstance(field, bytes) else field).rpartition("\t")
            if what in ("prompt", "cached"):
                prompts.setdefault(model, [0, 0])[0 if what == "prompt" else 1] += int(value)
            if what == "cached":
                continue  # of the prompt's tokens, not more of them
            slot = by_model.setdefault(model, [0, 0])
            slot[0 if what == "requests" else 1] += int(value)
        for model, (requests, tokens) in by_model.items():
            cells[(key, model)] = (requests, tokens)
    drawn = chart(keys, [h.strftime("%H:00") for h in hours], cells)
    drawn["prompt_cache"] = prompt_cache(prompts)
    return drawn


def prompt_cache(prompts: dict[str, list[int]]) -> list[dict]:
    """Per model with prompt tokens: how many, how many the engines took from their cache, and the hit rate."""
    rows = [
        {"model": model, "prompt": prompt, "cached": cached, "percent": round(100 * cached / prompt)}
        for model, (prompt, cached) in prompts.items()
        if prompt > 0
    ]
    return sorted(rows, key=lambda row: (-row["prompt"], row["model"]))[:MODELS_DRAWN]


def chart(
    slots: list[str], labels: list[str], cells: dict[tuple[str, str], tuple[int, int]], order: list[str] | None = None
) -> dict:
    """Chart.js datasets of requests and tokens per model: the busiest MODELS_DRAWN, the rest together.

    `order` is the busiest models when the caller has ranked them already (and put the rest under OTHERS).
    """
    tokens_by_model: dict[str, int] = {}
    for (_, model), (_, tokens) in cells.items():
        tokens_by_model[model] = tokens_by_model.get(model, 0) + tokens
    requests_by_model: dict[str, int] = {}
    for (_, model), (requests, _) in cells.items():
        requests_by_model[model] = requests_by_model.get(model, 0) + requests
    ranked = (
        order
        if order is not None
        else sorted(tokens_by_model, key=lambda m: (-tokens_by_model[m], -requests_by_model[m], m))
    )
    drawn = ranked[:MODELS_DRAWN]
    series = {model: ([0] * len(slots), [0] * len(slots)) for model in drawn}
    if len(ranked) > MODELS_DRAWN or OTHERS in tokens_by_model:
        series[OTHERS] = ([0] * len(slots), [0] * len(slots))
    index = {slot: i for i, slot in enumerate(slots)}
    for (slot, model), (requests, tokens) in cells.items():
        i = index.get(slot)
        if i is None:
            continue
        requests_row, tokens_row = series[model if model in drawn else OTHERS]
        requests_row[i] += requests
        tokens_row[i] += tokens
    return {
        "labels": labels,
        "requests": [{"label": model, "data": rows[0]} for model, rows in series.items()],
        "tokens": [{"label": model, "data": rows[1]} for model, rows in series.items()],
        "total_requests": sum(requests_by_model.values()),
        "total_tokens": sum(tokens_by_model.values()),
    }
