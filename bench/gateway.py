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
import asyncio
import os
import resource
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import uvloop
from benchlib import ROOT, free_port
from httpload import Connection, Sequential, Target, concurrent, open_streams, pct, sequential

LITELLM_VERSION = "1.110.2"
LITELLM_VENV = ROOT / "var" / "bench" / "litellm-venv"

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


def quiet_popen(argv: list[str], env: dict, log: Path, cwd: Path = ROOT) -> subprocess.Popen:
    return subprocess.Popen(
        argv, env=env, cwd=cwd, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True
    )


async def answers(target: Target, timeout: float = 60) -> bool:
    """Until a chat completion through `target` comes back 200 (routes and workers take a moment)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            connection = await Connection.open(target.port)
            response = await asyncio.wait_for(connection.send(target.request()), 10)
            connection.close()
            if response.ok:
                return True
        except (TimeoutError, OSError, ConnectionError):
            pass
        await asyncio.sleep(0.3)
    return False


# --- LiteLLM --------------------------------------------------------------------------------


def ensure_litellm() -> Path | None:
    """LiteLLM's proxy in its own venv, installed once; None, and why, if it cannot be had."""
    litellm = LITELLM_VENV / "bin" / "litellm"
    installed = LITELLM_VENV / f".installed-{LITELLM_VERSION}"  # not just bin/litellm: a half install has that
    if installed.exists():
        return litellm
    print(f"Installing litellm[proxy]=={LITELLM_VERSION} into {LITELLM_VENV} (once)...", flush=True)
    subprocess.run(["python3", "-m", "venv", str(LITELLM_VENV)], check=True)
    pip = [str(LITELLM_VENV / "bin" / "pip"), "install", "-q"]
    if subprocess.run(pip + [f"litellm[proxy]=={LITELLM_VERSION}"], capture_output=True).returncode != 0:
        # The proxy extra pins `litellm-proxy`, a package the registry here does not have, and two
        # helper packages at versions it does not have; the proxy's code ships in `litellm` itself.
        # So: litellm, then the extra's other requirements, the unavailable pins relaxed.
        if subprocess.run(pip + [f"litellm=={LITELLM_VERSION}"], capture_output=True).returncode != 0:
            print(f"LiteLLM {LITELLM_VERSION} could not be installed: it is left out of this run.")
            return None
        script = (
            "from importlib.metadata import requires\n"
            "from packaging.requirements import Requirement\n"
            "for r in requires('litellm'):\n"
            "    q = Requirement(r)\n"
            "    if q.marker and q.marker.evaluate({'extra': 'proxy'}) and not q.marker.evaluate({'extra': ''}):\n"
            "        if q.name == 'litellm-proxy': continue\n"
            "        print(q.name if q.name.startswith('litellm-') else str(q).split(';')[0])\n"
        )
        python = str(LITELLM_VENV / "bin" / "python")
        requirements = subprocess.run([python, "-c", script], capture_output=True, text=True).stdout.splitlines()
        if subprocess.run(pip + requirements, capture_output=True).returncode != 0:
            print("LiteLLM's proxy requirements could not be installed: it is left out of this run.")
            return None
    installed.touch()
    return litellm


def start_litellm(litellm: Path, stub_port: int, work: Path) -> tuple[subprocess.Popen, Target]:
    port = free_port()
    config = work / "litellm.yaml"
    models = "".join(
        f"""  - model_name: {name}
    litellm_params:
      model: openai/{name}
      api_base: http://127.0.0.1:{stub_port}/v1
      api_key: x
"""
        for name in ("stub", "stub-hold")
    )
    config.write_text(f"model_list:\n{models}litellm_settings:\n  telemetry: false\n")
    key = "sk-" + secrets.token_hex(32)
    env = dict(
        os.environ,
        LITELLM_MASTER_KEY=key,  # it refuses to start without one; llmgw checks a key too
        LITELLM_LOCAL_MODEL_COST_MAP="True",  # no fetch of the price list from the internet
        LITELLM_LOG="ERROR",
        LITELLM_TELEMETRY="False",
        DISABLE_ADMIN_UI="True",
    )
    for name in ("DATABASE_URL", "REDIS_URL", "REDIS_HOST"):
        env.pop(name, None)
    argv = [str(litellm), "--config", str(config), "--host", "127.0.0.1", "--port", str(port)]
    process = quiet_popen(argv + ["--num_workers", "1", "--telemetry", "False"], env, work / "litellm.log", work)
    return process, Target("LiteLLM", port, key=key, pid=process.pid)


# --- llmgw ----------------------------------------------------------------------------------

SEED = """
from catalog.models import Model, Profile
from fleet.models import Node, Replica
node, _ = Node.objects.get_or_create(name="bench")
for name in ("stub", "stub-hold"):
    model, _ = Model.objects.get_or_create(
        name=name, defaults=dict(source=f"http://127.0.0.1:1/{name}/v1/stub.gguf", context_length=100000, max_output=0)
    )
    Profile.objects.get_or_create(model=model, name="cpu", defaults=dict(engine="llamacpp"))
    Replica.objects.update_or_create(
        model_name=name, profile_name="cpu", node=node,
        defaults=dict(state="ready", endpoint="http://127.0.0.1:{stub_port}/v1"),
    )
"""


def start_redis(work: Path) -> tuple[subprocess.Popen, int]:
    """A Redis of the run's own, for per-key limits (which count in Redis)."""
    port = free_port()
    argv = ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no", "--dir", str(work)]
    return quiet_popen(argv, dict(os.environ), work / "redis.log"), port


def start_llmgw(
    stub_port: int,
    work: Path,
    name: str = "llmgw",
    redis_port: int | None = None,
    root: Path = ROOT,
    limited: bool = True,
    admin_load: AdminLoad | None = None,
    **settings: str,
) -> tuple[subprocess.Popen, list[Target]] | None:
    port = free_port()
    work = work / name
    work.mkdir()
    env = dict(
        os.environ,
        # A tree with `manage.py gateway` serves /v1/ there; an older one (say, main) in its admin server.
        LLMGW_GATEWAY_ADDR=f"127.0.0.1:{port}",
        LLMGW_ADMIN_ADDR=f"127.0.0.1:{port}",
        LLMGW_VAR=str(work / "var"),
        DATABASE_URL=f"sqlite:///{work / 'bench.sqlite3'}",
        # Without --limits nothing listens there, and it must not matter: a key without limits never asks Redis.
        REDIS_URL=f"redis://127.0.0.1:{redis_port or free_port()}/0",
        **settings,
    )
    manage = [sys.executable, str(root / "manage.py")]
    commands = subprocess.run(manage + ["help", "--commands"], env=env, cwd=root, capture_output=True, text=True)
    known = commands.stdout.split()
    server = "gateway" if "gateway" in known else "admin_server"
    if server not in known:
        print("llmgw: this tree has no `manage.py gateway` nor `admin_server`: it is left out of this run.")
        return None
    subprocess.run(manage + ["migrate", "-v", "0"], env=env, cwd=root, check=True)
    # Quietly: without Redis the catalog's signal warns that it could not queue a reconcile,
    # which does not matter here (the replicas are written ready).
    seeded = subprocess.run(
        manage + ["shell", "-c", SEED.replace("{stub_port}", str(stub_port))], env=env, cwd=root, capture_output=True
    )
    if seeded.returncode:
        raise SystemExit(f"llmgw: the routes could not be written:\n{seeded.stderr.decode()[-2000:]}")
    created = subprocess.run(
        manage + ["api_key", "create", "bench"], env=env, cwd=root, check=True, capture_output=True, text=True
    )
    key = created.stdout.strip().splitlines()[-1].strip()
    process = quiet_popen(manage + [server], env, work / "llmgw.log", cwd=root)
    targets = [Target(name, port, key=key, pid=process.pid)]
    if admin_load is not None:
        # The admin's heaviest page in a loop, on the admin server: its own process when the
        # gateway has one, the gateway's own process when it does not (an older tree).
        admin_url = f"http://127.0.0.1:{port}"
        if server == "gateway":
            admin_port = free_port()
            admin_env = dict(env, LLMGW_ADMIN_ADDR=f"127.0.0.1:{admin_port}")
            admin_load.processes.append(quiet_popen(manage + ["admin_server"], admin_env, work / "admin.log", cwd=root))
            admin_url = f"http://127.0.0.1:{admin_port}"
        made = f"from django.contrib.auth.models import User; User.objects.create_superuser('{ADMIN_USER}', '', 'x')"
        subprocess.run(manage + ["shell", "-c", made], env=env, cwd=root, check=True, capture_output=True)
        token = subprocess.run(
            manage + ["api_token", ADMIN_USER], env=env, cwd=root, check=True, capture_output=True, text=True
        ).stdout.strip()
        admin_load.add(admin_url, token)
    if redis_port and limited:
        # Limits set on every window and never reached: the request pays the check, not a refusal.
        limited = subprocess.run(
            manage
            + ["api_key", "create", "bench-limited", "--rpm", "1000000000", "--tpm", "1000000000"]
            + ["--tpd", "1000000000", "--tokens-per-month", "1000000000", "--in-flight", "100000"],
            env=env,
            cwd=root,
            check=True,
            capture_output=True,
            text=True,
        )
        secret = limited.stdout.strip().splitlines()[-1].strip()
        targets.append(Target(f"{name}+limits", port, key=secret, pid=process.pid))
        # Issue 35: a key of a team with every budget on too (and prices, so spend is counted), never reached.
        team = subprocess.run(
            manage
            + ["api_key", "create", "bench-team", "--rpm", "1000000000", "--tpm", "1000000000"]
            + ["--tpd", "1000000000", "--tokens-per-month", "1000000000", "--in-flight", "100000"],
            env=env,
            cwd=root,
            check=True,
            capture_output=True,
            text=True,
        )
        team_secret = team.stdout.strip().splitlines()[-1].strip()
        made = subprocess.run(manage + ["shell", "-c", TEAM_SEED], env=env, cwd=root, capture_output=True)
        if made.returncode == 0:
            targets.append(Target(f"{name}+team", port, key=team_secret, pid=process.pid))
        else:
            print(f"{name}: this tree has no teams' budgets: its +team key is left out of this run.")
    return process, targets


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


ADMIN_USER = "bench-staff"
# The API's OpenAPI schema: drf-spectacular walks every view and serializer, about a
# hundred milliseconds of Python a request, the heaviest thing a staff member can ask for.
ADMIN_PAGE = "/api/schema/"


class AdminLoad:
    """One client per admin server asking for ADMIN_PAGE in a loop, for the whole run."""

    def __init__(self) -> None:
        self.processes: list[subprocess.Popen] = []
        self.servers: list[tuple[str, str]] = []
        self.pages = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def add(self, url: str, token: str) -> None:
        self.servers.append((url, token))

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


async def release_held(stub_port: int) -> None:
    connection = await Connection.open(stub_port)
    raw = b"POST /release HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\n\r\n"
    await connection.send(raw)
    connection.close()


async def measure(
    direct: Target, proxies: list[Target], args: argparse.Namespace, redis_pid: int | None = None
) -> None:
    targets = [direct] + proxies
    names = [t.name for t in targets]
    print(f"\none at a time: {args.rounds} requests each, direct and one proxy taking turns", flush=True)
    # Each proxy is measured against direct requests interleaved with its own, so that
    # one proxy's after-work (LiteLLM logs and prices each answer) never lands on another's turn.
    plain, streamed = {}, {}
    for proxy in proxies:
        plain[proxy.name] = await sequential([direct, proxy], args.rounds, stream=False)
        streamed[proxy.name] = await sequential([direct, proxy], args.rounds, stream=True)

    print(f"{args.clients} concurrent: {args.duration:g} s each, best of {args.repeat}", flush=True)
    loaded = {}
    # Round by round, every target in turn: on a shared machine the load from elsewhere
    # changes over a minute, and a target measured all at once would take it all.
    for round_ in range(args.repeat):
        # Proxies in turn, and in reverse order every other round: none is always the one after direct.
        for t in [direct] + (proxies if round_ % 2 == 0 else proxies[::-1]):
            run = await concurrent(t, args.clients, args.duration, also=redis_pid)
            if t.name not in loaded or run.requests_per_second > loaded[t.name].requests_per_second:
                loaded[t.name] = run

    print(f"open streams: up to {args.streams} each", flush=True)
    held = {}
    for t in targets:
        held[t.name] = await open_streams(t, args.streams, lambda: release_held(direct.port))

    # --- the table ---
    d_load = loaded["direct"].seconds

    def one(n: str) -> Sequential:  # the direct column shows the first pair's direct requests
        return plain[n if n != "direct" else proxies[0].name]

    def one_stream(n: str) -> Sequential:
        return streamed[n if n != "direct" else proxies[0].name]

    rows: list[tuple[str, list[str]]] = []

    def row(label: str, value) -> None:
        rows.append((label, [value(n) for n in names]))

    row("one at a time, p50", lambda n: f"{ms(pct(one(n).seconds[n], 50)):.2f} ms")
    row("one at a time, p99", lambda n: f"{ms(pct(one(n).seconds[n], 99)):.2f} ms")
    added50 = {n: ms(pct(one(n).seconds[n], 50) - pct(one(n).seconds["direct"], 50)) for n in names}
    added99 = {n: ms(pct(one(n).seconds[n], 99) - pct(one(n).seconds["direct"], 99)) for n in names}
    row("  added p50", lambda n: f"{added50[n]:.2f} ms" if n != "direct" else "")
    row("  added p99", lambda n: f"{added99[n]:.2f} ms" if n != "direct" else "")
    gateway_ms = {n: statistics.median(one(n).gateway_ms[n]) if one(n).gateway_ms[n] else None for n in names}
    row("  Server-Timing gateway, p50", lambda n: f"{gateway_ms[n]:.2f} ms" if gateway_ms[n] is not None else "")
    first_added = {
        n: ms(pct(one_stream(n).first_event[n], 50) - pct(one_stream(n).first_event["direct"], 50)) for n in names
    }
    row("first streamed chunk, p50", lambda n: f"{ms(pct(one_stream(n).first_event[n], 50)):.2f} ms")
    row("  added", lambda n: f"{first_added[n]:.2f} ms" if n != "direct" else "")
    row("whole stream, p50", lambda n: f"{ms(pct(one_stream(n).seconds[n], 50)):.2f} ms")
    rps = {n: loaded[n].requests_per_second for n in names}
    row(f"{args.clients} concurrent, requests/s", lambda n: f"{rps[n]:,.0f}")
    row("  p50", lambda n: f"{ms(pct(loaded[n].seconds, 50)):.1f} ms")
    row("  p99", lambda n: f"{ms(pct(loaded[n].seconds, 99)):.1f} ms")
    row("  added p50", lambda n: f"{ms(pct(loaded[n].seconds, 50) - pct(d_load, 50)):.1f} ms" if n != "direct" else "")
    row("  added p99", lambda n: f"{ms(pct(loaded[n].seconds, 99) - pct(d_load, 99)):.1f} ms" if n != "direct" else "")
    row(
        "  server CPU per request",
        lambda n: f"{ms(loaded[n].cpu_seconds / max(1, len(loaded[n].seconds))):.2f} ms",
    )
    if redis_pid is not None:
        row(
            "  Redis CPU per request",
            lambda n: f"{ms(loaded[n].also_cpu_seconds / max(1, len(loaded[n].seconds))):.3f} ms",
        )
    row("open streams held", lambda n: f"{held[n].held:,} / {held[n].asked:,}")
    row("  completed when let go", lambda n: f"{held[n].completed:,}")
    row(
        "  a plain request meanwhile",
        lambda n: f"{held[n].answer_ms:.2f} ms" if held[n].answer_ms is not None else "none in 10 s",
    )
    row("  server memory (RSS)", lambda n: f"{held[n].rss_bytes / (1 << 20):.0f} MiB")
    errors = {n: one(n).errors[n] + one_stream(n).errors[n] + loaded[n].errors for n in names}
    row("errors (not open streams)", lambda n: str(errors[n]))

    width = max(len(label) for label, _ in rows) + 2
    print()
    print(f"{'':{width}}" + "".join(f"{n:>16}" for n in names))
    for label, values in rows:
        print(f"{label:{width}}" + "".join(f"{v:>16}" for v in values))

    llmgw = "llmgw" if "llmgw" in names else None
    litellm = "LiteLLM" if "LiteLLM" in names else None
    print()
    if llmgw and litellm:
        print(
            f"llmgw / LiteLLM: added p50 {added50[llmgw] / added50[litellm]:.2f} ×, "
            f"first chunk added {first_added[llmgw] / first_added[litellm]:.2f} ×, "
            f"requests/s {rps[llmgw] / rps[litellm]:.1f} ×, open streams {held[llmgw].held} vs {held[litellm].held}"
        )
    if llmgw:
        goals = [
            (f"added p50 one at a time ≤ {ADDED_P50_MS:g} ms", added50[llmgw] <= ADDED_P50_MS),
            (
                f"first streamed chunk ≤ {FIRST_CHUNK_ADDED_MS:g} ms later than direct",
                first_added[llmgw] <= FIRST_CHUNK_ADDED_MS,
            ),
            (f"{OPEN_STREAMS:,} open streams held on one process", held[llmgw].held >= OPEN_STREAMS),
        ]
        if litellm:
            goals.append(
                (f"requests/s ≥ {TIMES_LITELLM_RPS} × LiteLLM's", rps[llmgw] >= TIMES_LITELLM_RPS * rps[litellm])
            )
        if "llmgw+limits" in names:
            by_limits = added50["llmgw+limits"] - added50[llmgw]
            print(f"per-key limits: added p50 {added50['llmgw+limits']:.2f} ms, {by_limits:+.2f} ms over a key without")
            goals.append(
                (f"added p50 with limits ≤ {LIMITS_ADDED_P50_MS:g} ms", added50["llmgw+limits"] <= LIMITS_ADDED_P50_MS)
            )
            goals.append(
                (
                    f"requests/s with limits ≥ {LIMITS_TIMES_RPS:g} × without",
                    rps["llmgw+limits"] >= LIMITS_TIMES_RPS * rps[llmgw],
                )
            )
        if "llmgw+limits" in names and "llmgw+team" in names:
            by_team = added50["llmgw+team"] - added50["llmgw+limits"]
            print(
                f"teams' budgets: added p50 {added50['llmgw+team']:.2f} ms, {by_team:+.3f} ms over a key with its own "
                f"limits only; requests/s {rps['llmgw+team']:,.0f} against {rps['llmgw+limits']:,.0f} "
                f"({rps['llmgw+team'] / rps['llmgw+limits']:.2f} ×)"
            )
            goals.append(
                (
                    f"added p50 of a team's key within {TEAM_ADDED_P50_MS:g} ms of a key's own limits",
                    by_team <= TEAM_ADDED_P50_MS,
                )
            )
            goals.append(
                (
                    f"requests/s of a team's key ≥ {TEAM_TIMES_RPS:g} × a key's own limits",
                    rps["llmgw+team"] >= TEAM_TIMES_RPS * rps["llmgw+limits"],
                )
            )
        for goal, met in goals:
            print(f"{'met    ' if met else 'NOT met'}  {goal}")
    if "llmgw" in names and "baseline" in names:
        print(
            f"gateway process vs baseline: {args.clients} concurrent, requests/s {rps['llmgw']:,.0f} against "
            f"{rps['baseline']:,.0f} ({rps['llmgw'] / rps['baseline']:.2f} ×); added p50 one at a time "
            f"{added50['llmgw']:.2f} against {added50['baseline']:.2f} ms"
        )
    for name in ("llmgw", "baseline"):
        if name in names and f"{name}+limits" in names:
            print(
                f"{name} with every limit on: requests/s {rps[name + '+limits']:,.0f} against {rps[name]:,.0f} "
                f"({rps[name + '+limits'] / rps[name]:.2f} ×), added p50 {added50[name + '+limits']:.2f} ms"
            )
    if "llmgw" in names and "llmgw-2w" in names:
        print(
            f"gateway --workers: {args.clients} concurrent, requests/s {rps['llmgw']:,.0f} with 1, "
            f"{rps['llmgw-2w']:,.0f} with 2 ({rps['llmgw-2w'] / rps['llmgw']:.2f} ×); server CPU per request "
            f"{ms(loaded['llmgw'].cpu_seconds / max(1, len(loaded['llmgw'].seconds))):.2f} and "
            f"{ms(loaded['llmgw-2w'].cpu_seconds / max(1, len(loaded['llmgw-2w'].seconds))):.2f} ms"
        )
    if "baseline" in names and llmgw:
        # Issue 14: this tree's gateway against another's, in one run, taking turns.
        p50 = ms(pct(loaded[llmgw].seconds, 50) - pct(d_load, 50)) / ms(
            pct(loaded["baseline"].seconds, 50) - pct(d_load, 50)
        )
        print(
            f"llmgw / baseline: one at a time added p50 {added50[llmgw] - added50['baseline']:+.3f} ms; "
            f"{args.clients} concurrent added p50 {p50:.3f} ×, requests/s {rps[llmgw] / rps['baseline']:.3f} ×, "
            f"server CPU a request {loaded[llmgw].cpu_seconds / max(1, len(loaded[llmgw].seconds)) * 1e6:.0f} µs vs "
            f"{loaded['baseline'].cpu_seconds / max(1, len(loaded['baseline'].seconds)) * 1e6:.0f} µs"
        )
    for variant in (n for n in names if n.startswith("llmgw+")):
        # Issue 16: metrics (and the access log) within 5 % of the gateway without them.
        base = "llmgw"
        p50 = ms(pct(loaded[variant].seconds, 50) - pct(d_load, 50)) / ms(
            pct(loaded[base].seconds, 50) - pct(d_load, 50)
        )
        print(
            f"{variant} / {base}: one at a time added p50 {added50[variant] - added50[base]:+.3f} ms; "
            f"{args.clients} concurrent added p50 {p50:.3f} ×, requests/s {rps[variant] / rps[base]:.3f} ×"
        )


def main() -> None:
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
    # Stopped from outside (kill PID): the servers it started are stopped too, in `finally` below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    # 1,000 streams through a proxy are 2,000 sockets in it; the children inherit this.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 65536)), hard))

    work = Path(tempfile.mkdtemp(prefix="llmgw-bench-"))
    processes: list[subprocess.Popen] = []
    admin_load = AdminLoad() if args.admin_load else None
    try:
        stub_port = free_port()
        stub = quiet_popen(
            [sys.executable, str(ROOT / "bench" / "stub_upstream.py"), "--port", str(stub_port)],
            dict(os.environ),
            work / "stub.log",
        )
        processes.append(stub)
        direct = Target("direct", stub_port, pid=stub.pid)
        proxies = []
        redis_port = redis_pid = None
        if args.limits or args.baseline:
            # --baseline: both gateways with a Redis, as they run: the new one writes its load there.
            redis_process, redis_port = start_redis(work)
            redis_pid = redis_process.pid
            processes.append(redis_process)
        variants = {"llmgw": {}}
        if args.observability:
            # As `make run` runs it: counters in a multiprocess directory, /metrics adding them up.
            metrics = {"LLMGW_GATEWAY_METRICS": "true", "PROMETHEUS_MULTIPROC_DIR": str(work / "metrics")}
            (work / "metrics").mkdir()
            variants = {
                "llmgw": {"LLMGW_GATEWAY_METRICS": "false"},
                "llmgw+metrics": metrics,
                "llmgw+log": {**metrics, "LLMGW_GATEWAY_ACCESS_LOG": str(work / "access.jsonl")},
            }
        if args.workers:
            variants["llmgw-2w"] = {**variants["llmgw"], "LLMGW_GATEWAY_WORKERS": "2", "LLMGW_ADMIN_WORKERS": "2"}
        for name, settings in variants.items():
            started = start_llmgw(
                stub_port,
                work,
                name,
                redis_port if name == "llmgw" else None,
                limited=args.limits,
                admin_load=admin_load if name == "llmgw" else None,
                **settings,
            )
            if started:
                processes.append(started[0])
                proxies.extend(started[1])
        if args.baseline:
            started = start_llmgw(
                stub_port,
                work,
                "baseline",
                redis_port,
                root=Path(args.baseline).resolve(),
                limited=args.limits,
                admin_load=admin_load,
            )
            if started:
                processes.append(started[0])
                proxies.extend(started[1])
        litellm = None if args.no_litellm else ensure_litellm()
        if litellm:
            process, target = start_litellm(litellm, stub_port, work)
            processes.append(process)
            proxies.append(target)

        async def run() -> None:
            for target in [direct] + proxies:
                if not await answers(target):
                    log = work / f"{target.name.lower()}.log"
                    tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                    raise SystemExit(f"{target.name} did not answer a chat completion within 60 s\n{tail}")
            if admin_load is not None:
                admin_load.start()
            await measure(direct, proxies, args, redis_pid)
            if admin_load is not None:
                admin_load.stop()
                print(f"\nadmin load: {admin_load.pages} {ADMIN_PAGE} pages answered 200 during the run")

        if admin_load is not None:
            processes.extend(admin_load.processes)
        uvloop.run(run())
        print(f"\n{os.cpu_count()} cores; load average before the end: {os.getloadavg()[0]:.2f}")
    finally:
        for process in processes:
            try:
                os.killpg(process.pid, 15)
                process.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(process.pid, 9)
        if args.keep:
            print(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
