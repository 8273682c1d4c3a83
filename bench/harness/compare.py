"""Contenders side by side: rotating order, repeats, medians, one table, the goals' lines."""

from __future__ import annotations

import statistics
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


def rotation(names: Sequence[T], round_: int) -> list[T]:
    """`names` starting at this round's one, so that each goes first in turn: on a shared machine
    the load from elsewhere changes over a run, and a contender always measured first (just
    after a pause, or after the heaviest) would take more or less of it than the others."""
    k = round_ % len(names)
    return list(names[k:]) + list(names[:k])


def side_by_side(
    contenders: Mapping[str, Callable[[], T]],
    repeat: int,
    warmup: int = 0,
    each: Callable[[int, str, T], None] | None = None,
) -> dict[str, list[T]]:
    """Every contender's measurement `repeat` times (after `warmup` rounds not kept), in rotating order.

    `each(round, name, sample)` is called after every kept measurement, for a script that
    prints its progress."""
    samples: dict[str, list[T]] = {name: [] for name in contenders}
    for round_ in range(warmup + repeat):
        for name in rotation(list(contenders), round_):
            sample = contenders[name]()
            if round_ >= warmup:
                samples[name].append(sample)
                if each is not None:
                    each(round_ - warmup, name, sample)
    return samples


async def side_by_side_async(
    contenders: Mapping[str, Callable[[], Awaitable[T]]], repeat: int, warmup: int = 0
) -> dict[str, list[T]]:
    """`side_by_side` for measurements that run on the event loop."""
    samples: dict[str, list[T]] = {name: [] for name in contenders}
    for round_ in range(warmup + repeat):
        for name in rotation(list(contenders), round_):
            sample = await contenders[name]()
            if round_ >= warmup:
                samples[name].append(sample)
    return samples


def medians(samples: Mapping[str, list]) -> dict[str, Any]:
    """Each contender's median; where a sample is a dict of figures, the median of each figure."""
    out: dict[str, Any] = {}
    for name, values in samples.items():
        if values and isinstance(values[0], Mapping):
            out[name] = {key: statistics.median(v[key] for v in values) for key in values[0]}
        else:
            out[name] = statistics.median(values)
    return out


def best(samples: Mapping[str, list[T]], key: Callable[[T], float]) -> dict[str, T]:
    """Each contender's best sample by `key`: for a throughput under load from elsewhere,
    where the best run is the one least disturbed."""
    return {name: max(values, key=key) for name, values in samples.items()}


def pct(values: Sequence[float], p: float) -> float:
    """The p-th percentile, nearest rank; nan for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * p / 100))]


def timed(
    fn: Callable[[], T],
    runs: int,
    clock: Callable[[], float] = time.perf_counter,
    before: Callable[[], object] | None = None,
) -> tuple[float, T]:
    """The median of `runs` times of `fn` (wall time; `time.process_time` for this process's CPU),
    `before` run untimed ahead of each; and its last result."""
    times, result = [], None
    for _ in range(runs):
        if before is not None:
            before()
        started = clock()
        result = fn()
        times.append(clock() - started)
    return statistics.median(times), result


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    """The run's table, in Markdown, so that it pastes into docs/benchmarks.md as it is."""
    print("| " + " | ".join(header) + " |")
    print("| " + " | ".join("---" for _ in header) + " |")
    for row in rows:
        print("| " + " | ".join(str(cell) for cell in row) + " |")


@dataclass(frozen=True)
class Goal:
    """A goal declared beside its benchmark: the sentence printed and its test of the run's figures.

    A test that needs a contender this run left out (a KeyError) is not printed: that goal
    was not measured."""

    sentence: str
    test: Callable[[Any], bool]


def report(goals: Iterable[Goal], figures: Any) -> bool:
    """A "met" or "NOT met" line per goal measured; whether all of those were met."""
    all_met = True
    for goal in goals:
        try:
            met = bool(goal.test(figures))
        except KeyError:
            continue
        all_met = all_met and met
        print(f"{'met    ' if met else 'NOT met'}  {goal.sentence}")
    return all_met
