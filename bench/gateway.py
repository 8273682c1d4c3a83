#!/usr/bin/env python
"""llmgw's gateway vs LiteLLM's proxy: the same requests to one stub upstream, measured in one run.

    .venv/bin/python bench/gateway.py [--quick] [--rounds 2000] [--duration 10] [--streams 1000] [--limits]
                                      [--workers]

Starts bench/stub_upstream.py (answers at once; streams 20 chunks), llmgw's gateway
(`manage.py gateway`: one uvicorn process, /v1/ alone, its own database under a
temporary directory; a --baseline tree without that command serves /v1/ from its admin
server, `manage.py admin_server`, as llmgw did before the gateway had its own process) and LiteLLM's proxy (`litellm
--num_workers 1`, from PyPI, in its own venv under var/bench/litellm-venv, made the
first time), both routing the model `stub` to the stub. Then sends the same requests
directly to the stub and through each proxy, from this process (bench/httpload.py):

  one at a time     one kept-alive connection per target, direct and one proxy taking
                    turns; added latency = the proxy's p50 (p99) minus the direct p50 (p99)
  first chunk       the same with "stream": true: time to the first `data:` event
  64 concurrent     64 kept-alive connections for --duration seconds: requests per
                    second, and the added p50 and p99
  open streams      --streams streams that the stub holds open after their first
                    event: how many each one holds, whether it still answers a plain
                    request meanwhile, and its memory; then all are let go

With --limits, also through a second key of the same server with every per-key limit
set (and never reached), against a Redis of the run's own: what the limiter's one
round trip adds; and through a third key, of a team with every budget on (llmgw+team):
what counting the team's budgets in the same round trip adds.

With --workers, also llmgw's gateway with two processes (`gateway --workers 2`,
llmgw-2w) beside the one with one: requests per second for 1 and 2 workers side by side.

Prints a table, the ratios against LiteLLM, and whether each of the issue's goals is
met. The stub, the proxies and this load generator share the machine's cores; nothing
is pinned. Only loopback is used.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import uvloop
from harness import Goal, Servers, Site, best, free_port, report, side_by_side_async, stub_site, table
from harness.litellm import ensure_litellm, start_litellm
from httpload import (
    Concurrent,
    OpenStreams,
    Sequential,
    Target,
    answers,
    concurrent,
    open_streams,
    pct,
    release_held,
    sequential,
)

# The goals.
ADDED_P50_MS = 2.0
FIRST_CHUNK_ADDED_MS = 2.0
TIMES_LITELLM_RPS = 10
OPEN_STREAMS = 1000
# Issue 26: with every per-key limit on, at least this share of the requests per second without, and
# an added p50 one at a time of at most this.
LIMITS_TIMES_RPS = 0.9
LIMITS_ADDED_P50_MS = 0.6
# Issue 35: a key of a team with every budget on, against a key with its own limits only.
TEAM_ADDED_P50_MS = 0.1
TEAM_TIMES_RPS = 0.9

# Each goal's test reads the run's Figures; one whose contender this run left out is not printed.
GOALS = [
    Goal(f"added p50 one at a time ≤ {ADDED_P50_MS:g} ms", lambda f: f.added50["llmgw"] <= ADDED_P50_MS),
    Goal(
        f"first streamed chunk ≤ {FIRST_CHUNK_ADDED_MS:g} ms later than direct",
        lambda f: f.first_added["llmgw"] <= FIRST_CHUNK_ADDED_MS,
    ),
    Goal(f"{OPEN_STREAMS:,} open streams held on one process", lambda f: f.held["llmgw"].held >= OPEN_STREAMS),
    Goal(
        f"requests/s ≥ {TIMES_LITELLM_RPS} × LiteLLM's",
        lambda f: f.rps["llmgw"] >= TIMES_LITELLM_RPS * f.rps["LiteLLM"],
    ),
    Goal(
        f"added p50 with limits ≤ {LIMITS_ADDED_P50_MS:g} ms",
        lambda f: f.added50["llmgw+limits"] <= LIMITS_ADDED_P50_MS,
    ),
    Goal(
        f"requests/s with limits ≥ {LIMITS_TIMES_RPS:g} × without",
        lambda f: f.rps["llmgw+limits"] >= LIMITS_TIMES_RPS * f.rps["llmgw"],
    ),
    Goal(
        f"added p50 of a team's key within {TEAM_ADDED_P50_MS:g} ms of a key's own limits",
        lambda f: f.added50["llmgw+team"] - f.added50["llmgw+limits"] <= TEAM_ADDED_P50_MS,
    ),
    Goal(
        f"requests/s of a team's key ≥ {TEAM_TIMES_RPS:g} × a key's own limits",
        lambda f: f.rps["llmgw+team"] >= TEAM_TIMES_RPS * f.rps["llmgw+limits"],
    ),
]

# --- llmgw ----------------------------------------------------------------------------------

# Set on every window and never reached: the request pays the check, not a refusal.
EVERY_LIMIT = ["--rpm", "1000000000", "--tpm", "1000000000", "--tpd", "1000000000"]
EVERY_LIMIT += ["--tokens-per-month", "1000000000", "--in-flight", "100000"]

# A team with every budget set and never reached, the bench-team key in it, and prices on every model.
TEAM_SEED = """
from decimal import Decimal
from accounts.models import Team
from catalog.models import Model
from gateway.models import ApiKey
big = 10**9
team = Team.objects.create(name="bench-team", requests_per_minute=big, tokens_per_minute=big, tokens_per_day=big,
                           tokens_per_month=big, spend_per_month=Decimal(big))
ApiKey.objects.filter(name="bench-team").update(team=team)
Model.objects.update(price_input=Decimal("0.5"), price_cached_input=Decimal("0.25"), price_output=Decimal("1.5"))
"""


def llmgw_targets(site: Site | None, limited: bool, admin_load: AdminLoad | None = None) -> list[Target]:
    """A stub-routed llmgw started, and its targets: a key without limits, and with `limited` (a Redis)
    a key with every limit (+limits) and a team's key with every budget (+team)."""
    if site is None:
        return []
    key = site.create_key("bench")
    process = site.start()
    targets = [Target(site.name, site.port, key=key, pid=process.pid)]
    if admin_load is not None:
        admin_load.attach(site)
    if limited:
        limits_key = site.create_key("bench-limited", *EVERY_LIMIT)
        targets.append(Target(f"{site.name}+limits", site.port, limits_key, pid=process.pid))
        team_key = site.create_key("bench-team", *EVERY_LIMIT)
        if site.shell(TEAM_SEED).returncode == 0:
            targets.append(Target(f"{site.name}+team", site.port, key=team_key, pid=process.pid))
        else:
            print(f"{site.name}: this tree has no teams' budgets: its +team key is left out of this run.")
    return targets


ADMIN_USER = "bench-staff"
# The API's OpenAPI schema: drf-spectacular walks every view and serializer, about a
# hundred milliseconds of Python a request, the heaviest thing a staff member can ask for.
ADMIN_PAGE = "/api/schema/"


class AdminLoad:
    """One client per admin server asking for ADMIN_PAGE in a loop, for the whole run."""

    def __init__(self) -> None:
        self.servers: list[tuple[str, str]] = []
        self.pages = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def attach(self, site) -> None:
        """The admin server of `site`: its own process when the gateway has one, the gateway's
        own process when it does not (an older tree)."""
        url = f"http://127.0.0.1:{site.port}"
        if site.server == "gateway":
            admin_port = free_port()
            site.start("admin_server", LLMGW_ADMIN_ADDR=f"127.0.0.1:{admin_port}")
            url = f"http://127.0.0.1:{admin_port}"
        made = f"from django.contrib.auth.models import User; User.objects.create_superuser('{ADMIN_USER}', '', 'x')"
        if site.shell(made).returncode:
            raise SystemExit(f"{site.name}: the admin's user could not be made")
        self.servers.append((url, site.manage("api_token", ADMIN_USER).strip()))

    def start(self) -> None:
        for url, token in self.servers:
            thread = threading.Thread(target=self._loop, args=(url, token), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _loop(self, url: str, token: str) -> None:
        import requests

        session = requests.Session()
        session.headers["Authorization"] = f"Token {token}"
        while not self._stop.is_set():
            try:
                if session.get(url + ADMIN_PAGE, timeout=30).status_code == 200:
                    self.pages += 1
            except requests.RequestException:
                time.sleep(0.2)  # the admin server is still starting: nothing to poll but the page itself

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)


# --- the run --------------------------------------------------------------------------------


def ms(seconds: float) -> float:
    return seconds * 1000


@dataclass
class Figures:
    """What the run measured, by target name; the direct columns of one at a time are the first pair's."""

    names: list[str]
    plain: dict[str, Sequential]
    streamed: dict[str, Sequential]
    loaded: dict[str, Concurrent]
    held: dict[str, OpenStreams]

    def one(self, n: str) -> Sequential:
        return self.plain[n if n != "direct" else self.names[1]]

    def one_stream(self, n: str) -> Sequential:
        return self.streamed[n if n != "direct" else self.names[1]]

    def __post_init__(self) -> None:
        def added(of, n: str, p: float) -> float:
            return ms(pct(of(n).seconds[n], p) - pct(of(n).seconds["direct"], p))

        self.added50 = {n: added(self.one, n, 50) for n in self.names}
        self.added99 = {n: added(self.one, n, 99) for n in self.names}
        self.first_added = {
            n: ms(pct(self.one_stream(n).first_event[n], 50) - pct(self.one_stream(n).first_event["direct"], 50))
            for n in self.names
        }
        self.rps = {n: self.loaded[n].requests_per_second for n in self.names}

    def loaded_added(self, n: str, p: float) -> float:
        return ms(pct(self.loaded[n].seconds, p) - pct(self.loaded["direct"].seconds, p))

    def cpu_per_request(self, n: str, of: str = "cpu_seconds") -> float:
        return ms(getattr(self.loaded[n], of) / max(1, len(self.loaded[n].seconds)))


async def measure(direct: Target, proxies: list[Target], args: argparse.Namespace, redis_pid: int | None) -> Figures:
    print(f"\none at a time: {args.rounds} requests each, direct and one proxy taking turns", flush=True)
    # Each proxy is measured against direct requests interleaved with its own, so that
    # one proxy's after-work (LiteLLM logs and prices each answer) never lands on another's turn.
    plain, streamed = {}, {}
    for proxy in proxies:
        plain[proxy.name] = await sequential([direct, proxy], args.rounds, stream=False)
        streamed[proxy.name] = await sequential([direct, proxy], args.rounds, stream=True)

    print(f"{args.clients} concurrent: {args.duration:g} s each, best of {args.repeat}", flush=True)
    targets = [direct] + proxies
    runs = await side_by_side_async(
        {t.name: (lambda t=t: concurrent(t, args.clients, args.duration, also=redis_pid)) for t in targets},
        args.repeat,
    )
    loaded = best(runs, key=lambda run: run.requests_per_second)

    print(f"open streams: up to {args.streams} each", flush=True)
    held = {t.name: await open_streams(t, args.streams, lambda: release_held(direct.port)) for t in targets}
    return Figures([t.name for t in targets], plain, streamed, loaded, held)


def rows(f: Figures, args: argparse.Namespace, with_redis: bool) -> list[tuple[str, list[str]]]:
    """The table's rows: a label and the cell of each target."""
    proxied = [n for n in f.names if n != "direct"]
    cells = [
        ("one at a time, p50", lambda n: f"{ms(pct(f.one(n).seconds[n], 50)):.2f} ms"),
        ("one at a time, p99", lambda n: f"{ms(pct(f.one(n).seconds[n], 99)):.2f} ms"),
        ("  added p50", lambda n: f"{f.added50[n]:.2f} ms" if n in proxied else ""),
        ("  added p99", lambda n: f"{f.added99[n]:.2f} ms" if n in proxied else ""),
        (
            "  Server-Timing gateway, p50",
            lambda n: f"{statistics.median(f.one(n).gateway_ms[n]):.2f} ms" if f.one(n).gateway_ms[n] else "",
        ),
        ("first streamed chunk, p50", lambda n: f"{ms(pct(f.one_stream(n).first_event[n], 50)):.2f} ms"),
        ("  added", lambda n: f"{f.first_added[n]:.2f} ms" if n in proxied else ""),
        ("whole stream, p50", lambda n: f"{ms(pct(f.one_stream(n).seconds[n], 50)):.2f} ms"),
        (f"{args.clients} concurrent, requests/s", lambda n: f"{f.rps[n]:,.0f}"),
        ("  p50", lambda n: f"{ms(pct(f.loaded[n].seconds, 50)):.1f} ms"),
        ("  p99", lambda n: f"{ms(pct(f.loaded[n].seconds, 99)):.1f} ms"),
        ("  added p50", lambda n: f"{f.loaded_added(n, 50):.1f} ms" if n in proxied else ""),
        ("  added p99", lambda n: f"{f.loaded_added(n, 99):.1f} ms" if n in proxied else ""),
        ("  server CPU per request", lambda n: f"{f.cpu_per_request(n):.2f} ms"),
    ]
    if with_redis:
        cells.append(("  Redis CPU per request", lambda n: f"{f.cpu_per_request(n, 'also_cpu_seconds'):.3f} ms"))
    cells += [
        ("open streams held", lambda n: f"{f.held[n].held:,} / {f.held[n].asked:,}"),
        ("  completed when let go", lambda n: f"{f.held[n].completed:,}"),
        (
            "  a plain request meanwhile",
            lambda n: f"{f.held[n].answer_ms:.2f} ms" if f.held[n].answer_ms is not None else "none in 10 s",
        ),
        ("  server memory (RSS)", lambda n: f"{f.held[n].rss_bytes / (1 << 20):.0f} MiB"),
        (
            "errors (not open streams)",
            lambda n: str(f.one(n).errors[n] + f.one_stream(n).errors[n] + f.loaded[n].errors),
        ),
    ]
    return [(label, [cell(n) for n in f.names]) for label, cell in cells]


def _both(a: str, b: str):
    return lambda f: a in f.names and b in f.names


# The lines under the table, each printed where the contenders it sets side by side ran: BESIDE
# before the goals' lines, AFTER them.
BESIDE = [
    (
        _both("llmgw", "LiteLLM"),
        lambda f, a: f"llmgw / LiteLLM: added p50 {f.added50['llmgw'] / f.added50['LiteLLM']:.2f} ×, "
        f"first chunk added {f.first_added['llmgw'] / f.first_added['LiteLLM']:.2f} ×, "
        f"requests/s {f.rps['llmgw'] / f.rps['LiteLLM']:.1f} ×, "
        f"open streams {f.held['llmgw'].held} vs {f.held['LiteLLM'].held}",
    ),
    (
        _both("llmgw", "llmgw+limits"),
        lambda f, a: f"per-key limits: added p50 {f.added50['llmgw+limits']:.2f} ms, "
        f"{f.added50['llmgw+limits'] - f.added50['llmgw']:+.2f} ms over a key without",
    ),
    (
        _both("llmgw+limits", "llmgw+team"),
        lambda f, a: f"teams' budgets: added p50 {f.added50['llmgw+team']:.2f} ms, "
        f"{f.added50['llmgw+team'] - f.added50['llmgw+limits']:+.3f} ms over a key with its own "
        f"limits only; requests/s {f.rps['llmgw+team']:,.0f} against {f.rps['llmgw+limits']:,.0f} "
        f"({f.rps['llmgw+team'] / f.rps['llmgw+limits']:.2f} ×)",
    ),
]
AFTER = [
    (
        _both("llmgw", "baseline"),
        lambda f, a: f"gateway process vs baseline: {a.clients} concurrent, requests/s {f.rps['llmgw']:,.0f} "
        f"against {f.rps['baseline']:,.0f} ({f.rps['llmgw'] / f.rps['baseline']:.2f} ×); added p50 one at a "
        f"time {f.added50['llmgw']:.2f} against {f.added50['baseline']:.2f} ms",
    ),
    *(
        (
            _both(name, f"{name}+limits"),
            lambda f, a, n=name: f"{n} with every limit on: requests/s {f.rps[n + '+limits']:,.0f} against "
            f"{f.rps[n]:,.0f} ({f.rps[n + '+limits'] / f.rps[n]:.2f} ×), added p50 {f.added50[n + '+limits']:.2f} ms",
        )
        for name in ("llmgw", "baseline")
    ),
    (
        _both("llmgw", "llmgw-2w"),
        lambda f, a: f"gateway --workers: {a.clients} concurrent, requests/s {f.rps['llmgw']:,.0f} with 1, "
        f"{f.rps['llmgw-2w']:,.0f} with 2 ({f.rps['llmgw-2w'] / f.rps['llmgw']:.2f} ×); server CPU per request "
        f"{f.cpu_per_request('llmgw'):.2f} and {f.cpu_per_request('llmgw-2w'):.2f} ms",
    ),
    (
        # Issue 14: this tree's gateway against another's, in one run, taking turns.
        _both("llmgw", "baseline"),
        lambda f, a: f"llmgw / baseline: one at a time added p50 {f.added50['llmgw'] - f.added50['baseline']:+.3f} "
        f"ms; {a.clients} concurrent added p50 {f.loaded_added('llmgw', 50) / f.loaded_added('baseline', 50):.3f} ×, "
        f"requests/s {f.rps['llmgw'] / f.rps['baseline']:.3f} ×, server CPU a request "
        f"{f.cpu_per_request('llmgw') * 1000:.0f} µs vs {f.cpu_per_request('baseline') * 1000:.0f} µs",
    ),
]


def variant_lines(f: Figures, args: argparse.Namespace) -> list[str]:
    """Issue 16: each llmgw+ variant (metrics, the access log, limits) against llmgw without it."""
    return [
        f"{variant} / llmgw: one at a time added p50 {f.added50[variant] - f.added50['llmgw']:+.3f} ms; "
        f"{args.clients} concurrent added p50 {f.loaded_added(variant, 50) / f.loaded_added('llmgw', 50):.3f} ×, "
        f"requests/s {f.rps[variant] / f.rps['llmgw']:.3f} ×"
        for variant in f.names
        if variant.startswith("llmgw+")
    ]


def print_figures(f: Figures, args: argparse.Namespace, with_redis: bool) -> None:
    print()
    table(["what", *f.names], [(label, *cells) for label, cells in rows(f, args, with_redis)])
    print()
    for ran, line in BESIDE:
        if ran(f):
            print(line(f, args))
    report(GOALS, f)
    for ran, line in AFTER:
        if ran(f):
            print(line(f, args))
    for line in variant_lines(f, args):
        print(line)


def variants(args: argparse.Namespace, work) -> dict[str, dict[str, str]]:
    """This tree's llmgw contenders and their settings."""
    found = {"llmgw": {}}
    if args.observability:
        # As `make run` runs it: counters in a multiprocess directory, /metrics adding them up.
        metrics = {"LLMGW_GATEWAY_METRICS": "true", "PROMETHEUS_MULTIPROC_DIR": str(work / "metrics")}
        (work / "metrics").mkdir()
        found = {
            "llmgw": {"LLMGW_GATEWAY_METRICS": "false"},
            "llmgw+metrics": metrics,
            "llmgw+log": {**metrics, "LLMGW_GATEWAY_ACCESS_LOG": str(work / "access.jsonl")},
        }
    if args.workers:
        found["llmgw-2w"] = {**found["llmgw"], "LLMGW_GATEWAY_WORKERS": "2", "LLMGW_ADMIN_WORKERS": "2"}
    return found


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--quick", action="store_true", help="a short run: fewer requests, shorter loads")
    parser.add_argument("--rounds", type=int, default=2000, help="requests one at a time, each target")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--duration", type=float, default=10, help="seconds of concurrent load, each target")
    parser.add_argument(
        "--repeat",
        type=int,
        default=None,
        help="concurrent runs each target, taking turns; the best counts (2; --quick 1)",
    )
    parser.add_argument("--streams", type=int, default=OPEN_STREAMS)
    parser.add_argument("--no-litellm", action="store_true")
    parser.add_argument(
        "--observability",
        action="store_true",
        help="llmgw without metrics beside llmgw with them (llmgw+metrics) and with the access log too (llmgw+log)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the work directory and its logs")
    parser.add_argument(
        "--baseline",
        metavar="TREE",
        help="also llmgw from another checkout (say, main in a git worktree), measured beside this one as 'baseline'",
    )
    parser.add_argument(
        "--limits", action="store_true", help="also through a key with per-key limits set (a Redis of its own)"
    )
    parser.add_argument("--workers", action="store_true", help="also llmgw's gateway with two processes (llmgw-2w)")
    parser.add_argument(
        "--admin-load",
        action="store_true",
        help=f"the admin's {ADMIN_PAGE} asked in a loop on each llmgw's admin server throughout the run",
    )
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.duration = 300, 3
    if args.repeat is None:
        args.repeat = 1 if args.quick else 2
    return args


def main() -> None:
    args = arguments()
    # 1,000 streams through a proxy are 2,000 sockets in it; the children inherit this.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 65536)), hard))
    admin_load = AdminLoad() if args.admin_load else None
    with Servers(keep=args.keep) as servers:
        stub, stub_port = servers.stub()
        direct = Target("direct", stub_port, pid=stub.pid)
        redis_port = redis_pid = None
        if args.limits or args.baseline:
            # --baseline: both gateways with a Redis, as they run: the new one writes its load there.
            redis_process, redis_port = servers.redis()
            redis_pid = redis_process.pid
        proxies = []
        # One key opens every held stream and then asks a plain request: llmgw's cap on one key's requests
        # at once (LLMGW_GATEWAY_KEY_CONCURRENCY, 256) refused the other 744 and the plain one, which read
        # as "completed when let go 256" and "none in 10 s" (2026-12-04). The run measures the process.
        one_key = {"LLMGW_GATEWAY_KEY_CONCURRENCY": str(args.streams + 64)}
        for name, settings in variants(args, servers.work).items():
            first = name == "llmgw"
            site = stub_site(servers, stub_port, name, None, redis_port if first else None, **one_key, **settings)
            proxies += llmgw_targets(site, args.limits and first, admin_load if first else None)
        if args.baseline:
            site = stub_site(servers, stub_port, "baseline", Path(args.baseline).resolve(), redis_port, **one_key)
            proxies += llmgw_targets(site, args.limits, admin_load)
        litellm = None if args.no_litellm else ensure_litellm()
        if litellm:
            process, port, key = start_litellm(servers, litellm, stub_port)
            proxies.append(Target("LiteLLM", port, key=key, pid=process.pid))

        async def run() -> Figures:
            for target in [direct] + proxies:
                if not await answers(target):
                    tail = servers.log_tail(target.name.lower())
                    raise SystemExit(f"{target.name} did not answer a chat completion within 60 s\n{tail}")
            if admin_load is not None:
                admin_load.start()
            figures = await measure(direct, proxies, args, redis_pid)
            if admin_load is not None:
                admin_load.stop()
            return figures

        figures = uvloop.run(run())
        print_figures(figures, args, redis_pid is not None)
        if admin_load is not None:
            print(f"\nadmin load: {admin_load.pages} {ADMIN_PAGE} pages answered 200 during the run")
        print(f"\n{os.cpu_count()} cores; load average before the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
