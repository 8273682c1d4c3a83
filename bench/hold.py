"""What issue 14 adds to a request whose model has a ready replica, measured on its own.

    .venv/bin/python bench/hold.py [--requests 200000]

bench/gateway.py --baseline measures the whole gateway, this tree beside another; on a
shared two-core machine its figures at 64 concurrent move by more than what is measured
here. This runs, on an event loop, what a request with a ready replica now does more
than before: the load counts (`Demand.arrived`, `started`, `finished`: two dict updates
and a clock read), the route looked up again and the extra coroutine (`Gateway.answer`)
around `forward`, and reports the time per request at p50 and p99, against the same
loop without them.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200_000)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")
    import django

    django.setup()
    from gateway.demand import Demand
    from gateway.routes import Route, Table, Upstream

    route = Route("stub", (), 1000, 0, 0, (Upstream(1, "http://127.0.0.1:1/v1", 1),))
    table = Table(routes={"stub": route}, models=[route])
    demand = Demand({1: 0})

    async def forward() -> int:
        return 0

    async def answer(name: str) -> int:  # as Gateway.answer with a usable replica: one look, one try
        current = table.routes.get(name, route)
        if not current.upstreams:
            raise AssertionError
        demand.started(name)
        try:
            return await forward()
        finally:
            demand.finished(name)

    async def before() -> None:
        await forward()

    async def after() -> None:
        demand.arrived("stub")
        await answer("stub")

    async def measure(one) -> list[float]:
        times = []
        clock = time.perf_counter
        for _ in range(args.requests):
            started = clock()
            await one()
            times.append(clock() - started)
        return times

    async def run() -> None:
        results: dict[str, list[float]] = {"before": [], "after": []}
        for _ in range(5):  # taking turns, so that the machine's other load falls on both
            for name, one in (("before", before), ("after", after)):
                results[name] += await measure(one)
        for name, times in results.items():
            times.sort()
            p50, p99 = statistics.median(times), times[int(len(times) * 0.99)]
            print(f"{name:>7}: p50 {p50 * 1e6:.2f} µs, p99 {p99 * 1e6:.2f} µs")
        added = statistics.median(results["after"]) - statistics.median(results["before"])
        print(f"added: {added * 1e6:.2f} µs a request at p50")

    asyncio.run(run())


if __name__ == "__main__":
    main()
