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
import statistics
import time

from harness import django_setup, pct, side_by_side_async, table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200_000)
    args = parser.parse_args()
    django_setup()
    from gateway.conversations import Conversations
    from gateway.demand import Demand
    from gateway.routes import Route, Table, Upstream

    route = Route("stub", (), 1000, 0, 0, (Upstream(1, "http://127.0.0.1:1/v1", 1),))
    routes = Table(routes={"stub": route}, models=[route])
    demand = Demand({1: 0}, Conversations())

    async def forward() -> int:
        return 0

    async def answer(name: str) -> int:  # as Gateway.answer with a usable replica: one look, one try
        current = routes.routes.get(name, route)
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

    def measured(one):
        async def measure() -> list[float]:
            times = []
            clock = time.perf_counter
            for _ in range(args.requests):
                started = clock()
                await one()
                times.append(clock() - started)
            return times

        return measure

    # Five rounds taking turns, so that the machine's other load falls on both.
    samples = asyncio.run(side_by_side_async({"before": measured(before), "after": measured(after)}, 5))
    times = {name: [t for run in runs for t in run] for name, runs in samples.items()}
    table(
        ["", "p50", "p99"],
        [(name, f"{statistics.median(t) * 1e6:.2f} µs", f"{pct(t, 99) * 1e6:.2f} µs") for name, t in times.items()],
    )
    added = statistics.median(times["after"]) - statistics.median(times["before"])
    print(f"added: {added * 1e6:.2f} µs a request at p50")


if __name__ == "__main__":
    main()
