"""Usage by day and model as a stacked bar chart, drawn on the server as SVG: no script, no CDN."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import date, timedelta

from django.db.models import F, QuerySet, Sum

# Told apart by colour-blind readers too (Okabe and Ito's palette); a ninth model reuses the first colour.
COLOURS = ["#0072b2", "#e69f00", "#009e73", "#cc79a7", "#56b4e9", "#d55e00", "#f0e442", "#000000"]
WIDTH, HEIGHT, BOTTOM = 720, 200, 20


@dataclass
class Segment:
    model: str
    tokens: int
    y: float
    height: float
    colour: str


@dataclass
class Bar:
    day: date
    x: float
    width: float
    tokens: int
    segments: list[Segment] = field(default_factory=list)


@dataclass
class Chart:
    bars: list[Bar]
    legend: list[tuple[str, str]]  # (model, colour)
    most: int
    width: int = WIDTH
    height: int = HEIGHT + BOTTOM

    @property
    def empty(self) -> bool:
        return self.most == 0


def usage_chart(rows: QuerySet, last_day: date, days: int = 30) -> Chart:
    """Tokens per day of the `days` up to `last_day`, each day's bar split by model."""
    first = last_day - timedelta(days=days - 1)
    totals = (
        rows.filter(day__gte=first, day__lte=last_day)
        .values("day", "model_name")
        .annotate(tokens=Sum(F("prompt_tokens") + F("completion_tokens")))
        .order_by("day", "model_name")
    )
    by_day: dict[date, dict[str, int]] = defaultdict(dict)
    models: list[str] = []
    for row in totals:
        by_day[row["day"]][row["model_name"]] = row["tokens"] or 0
        if row["model_name"] not in models:
            models.append(row["model_name"])
    models.sort()
    colour = {model: COLOURS[i % len(COLOURS)] for i, model in enumerate(models)}
    most = max((sum(day.values()) for day in by_day.values()), default=0)
    slot = WIDTH / days
    bars = []
    for i in range(days):
        day = first + timedelta(days=i)
        counts = by_day.get(day, {})
        bar = Bar(day=day, x=round(i * slot + 1, 1), width=round(slot - 2, 1), tokens=sum(counts.values()))
        top = float(HEIGHT)
        for model in models:
            tokens = counts.get(model, 0)
            if not tokens:
                continue
            height = round(tokens * HEIGHT / most, 1)
            top -= height
            bar.segments.append(Segment(model, tokens, round(top, 1), height, colour[model]))
        bars.append(bar)
    return Chart(bars=bars, legend=[(m, colour[m]) for m in models], most=most)
