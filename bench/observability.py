"""What the gateway's metrics and access log cost a request, measured on their own.

    .venv/bin/python bench/observability.py [--requests 50000]

bench/gateway.py measures the whole gateway with them off and on, side by side; on a
shared two-core machine its figures move by more than what is measured here. This runs
the hooks the gateway calls for one answered request (`begin`, `routed`, `answered`, the
answer's start and body through the observing `send`, `end`) in a loop on an event
loop, and reports the time per request at p50 and p99 with:

  off          LLMGW_GATEWAY_METRICS=false, no access log: X-Request-Id only
  metrics      the gateway's counts (plain numbers, read by a collector at scrape time)
  + log        metrics and the JSON access log written to a file

Each variant runs in its own process, with PROMETHEUS_MULTIPROC_DIR set as `make run` sets it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from harness import Servers, django_setup, medians, side_by_side, table


def one_variant(requests: int) -> dict:
    import asyncio
    import time

    django_setup()
    from gateway.metrics import Observer

    observer = Observer()
    observer._count_hour = lambda *a: None  # Redis is not what is measured
    headers = [(b"host", b"127.0.0.1"), (b"authorization", b"Bearer x"), (b"content-type", b"application/json")]
    request = {"model": "stub", "stream": False}

    async def sent(message) -> None:
        pass

    async def run() -> list[float]:
        times = []
        for _ in range(requests):
            scope = {"type": "http", "path": "/v1/chat/completions", "method": "POST", "headers": headers}
            started = time.perf_counter()
            exchange, send = observer.begin(scope, sent, started)
            observer.routed(scope, "stub", request, "bench")
            observer.answered(scope, 1, 0.00004, 11, 3)
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"json")]})
            await send({"type": "http.response.body", "body": b"{}"})
            observer.end(exchange)
            times.append(time.perf_counter() - started)
        return times

    times = asyncio.run(run())[requests // 10 :]  # the first tenth warms up
    times.sort()
    return {"p50_us": times[len(times) // 2] * 1e6, "p99_us": times[int(len(times) * 0.99)] * 1e6}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=50000)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--runs", type=int, default=3, help="runs of each variant; the median p50 is shown")
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(one_variant(args.requests)))
        return 0
    with Servers("llmgw-bench-observability-") as servers:
        work = servers.work
        (work / "metrics").mkdir()
        metrics = {"LLMGW_GATEWAY_METRICS": "true", "PROMETHEUS_MULTIPROC_DIR": str(work / "metrics")}
        variants = {
            "off": {"LLMGW_GATEWAY_METRICS": "false"},
            "metrics": metrics,
            "+ log": {**metrics, "LLMGW_GATEWAY_ACCESS_LOG": str(work / "access.jsonl")},
        }

        def run(name: str, settings: dict):
            def one_run() -> dict:
                env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
                env.update(settings, LLMGW_VAR=str(work / "var"), REDIS_URL="redis://127.0.0.1:1/0")
                argv = [sys.executable, __file__, "--variant", name, "--requests", str(args.requests)]
                out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
                return json.loads(out.stdout.strip().splitlines()[-1])

            return one_run

        results = medians(side_by_side({name: run(name, v) for name, v in variants.items()}, args.runs))
    off = results["off"]["p50_us"]
    print(f"{args.requests:,} requests through the gateway's hooks, median of {args.runs} runs each")
    table(
        ["what", "p50", "p99", "p50 added to off"],
        [
            (
                name,
                f"{r['p50_us']:.1f} µs",
                f"{r['p99_us']:.1f} µs",
                f"{r['p50_us'] - off:+.1f} µs" if name != "off" else "",
            )
            for name, r in results.items()
        ],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
