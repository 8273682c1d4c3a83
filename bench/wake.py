#!/usr/bin/env python
"""Waking a model at zero replicas, weights cached: llmgw's path against the engine's own start.

    .venv/bin/python bench/wake.py [--runs 5]

On this machine: a Redis, the byte listener, a control worker (Celery, queue `control`)
and one agent (`manage.py agent`, with its engine supervisor), on SmolLM2-135M-Instruct
Q4_1 (launcher/smollm2.py). The model is served with fewest 0 and most 1, woken once so
the node caches its weights, and taken back to zero. Then, `--runs` times each:

  llmgw    `fleet.wake` sent on the control queue, as the gateway's first waiting
           request sends it (contracts/demand.py) -> the replica reported ready in the
           database -> the first streamed token, asked of the engine directly
  engine   the same engine started by hand (`agent.engines.command` and `spawn`, the
           agent's own argument list) on the cached file -> it answers /v1/models
           (asked every 20 ms) -> the first streamed token

The difference is what waking costs llmgw: the task, the reconcile pass, the start
message, the agent's cache check, the supervisor's loop, the ready report. The gateway's
hold of the request (issue 14's other half) is not in this path: it adds the time from
the replica's ready to the gateway seeing it (its routing table refresh). Only loopback.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from benchlib import free_port, start_byte_listener  # noqa: E402

MODEL = "smollm2-135m"
ASK = {
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "max_tokens": 8,
    "temperature": 0,
    "stream": True,
}


def first_token(endpoint: str) -> float:
    """When the first streamed token of a short answer arrived (monotonic)."""
    with requests.post(endpoint + "/chat/completions", json={"model": MODEL, **ASK}, stream=True, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines(decode_unicode=True):
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                    return time.monotonic()
    raise SystemExit("the engine streamed no token")


def until(condition, timeout: float, what: str, interval: float = 0.01):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(interval)
    raise SystemExit(f"timed out waiting for {what}")


def summary(values: list[float]) -> str:
    return f"median {statistics.median(values):.2f} s (min {min(values):.2f}, max {max(values):.2f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--runs", type=int, default=5)
    options = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="llmgw-bench-wake-"))
    redis_port = free_port()
    processes: list[subprocess.Popen] = []

    def spawn(argv: list[str], name: str, **env) -> subprocess.Popen:
        log = open(work / f"{name}.log", "ab")
        process = subprocess.Popen(
            argv, cwd=ROOT, env=dict(os.environ, **env), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        processes.append(process)
        return process

    spawn(["redis-server", "--port", str(redis_port), "--save", "", "--appendonly", "no"], "redis")
    os.environ.update(
        REDIS_URL=f"redis://127.0.0.1:{redis_port}/0",
        LLMGW_VAR=str(work / "var"),
        LLMGW_MIRROR_ROOT=str(work / "mirror"),
        DATABASE_URL=f"sqlite:///{work / 'bench.sqlite3'}",
        DJANGO_SETTINGS_MODULE="llmgw_site.settings",
        PYTHONUNBUFFERED="1",
    )
    import django

    django.setup()
    from celery import current_app
    from django.core.management import call_command

    from agent import engine_state, engines
    from catalog.models import Model, Profile
    from contracts import demand, tasks
    from fleet import reconcile
    from fleet.enrolment import issue_token
    from fleet.models import Node, Replica, Scale
    from launcher import smollm2

    call_command("migrate", verbosity=0)
    weights = smollm2.gguf_path()
    version = work / "mirror" / MODEL / "instruct-q4_1"
    version.mkdir(parents=True)
    shutil.copyfile(weights, version / weights.name)
    cache = work / "cache"
    try:
        byte_listener, bytes_url = start_byte_listener(work / "mirror", work)
        processes.append(byte_listener)
        python = sys.executable
        spawn([python, "-m", "celery", "-A", "llmgw_site", "worker", "-Q", "control", "-c", "2"], "control")
        token = issue_token("n1")
        spawn(
            [python, "manage.py", "agent", "--node", "n1", "--cache", str(cache)],
            "agent",
            LLMGW_NODE_TOKEN=token,
            LLMGW_BYTES_URL=bytes_url,
            LLMGW_HEARTBEAT_S="1",
        )
        until(
            lambda: (n := Node.objects.filter(name="n1").first()) and n.state == "ready" and "llamacpp" in n.engines,
            180,
            "the agent's heartbeat",
            0.2,
        )
        model = Model.objects.create(
            name=MODEL,
            source=f"{bytes_url}{MODEL}/instruct-q4_1/{weights.name}",
            context_length=2048,
            scaling_min=0,
            scaling_max=1,
        )
        Profile.objects.create(model=model, name="cpu", engine="llamacpp", args=["--ctx-size", "2048"])

        def wake() -> Replica:
            current_app.send_task(demand.WAKE, args=[MODEL], queue=tasks.CONTROL_QUEUE)
            return until(lambda: Replica.objects.filter(model_name=MODEL, state="ready").first(), 180, "ready")

        def to_zero() -> None:
            # What the idle time does, without waiting for it.
            Scale.objects.filter(model_name=MODEL).update(replicas=0, why="idle (bench)")
            until(lambda: reconcile.reconcile() is not None, 30, "the reconcile lock")
            until(lambda: not Replica.objects.exists(), 60, "the replica to stop")
            until(lambda: not engine_state.running_engines(cache), 60, "the engine to stop")

        # Once to fetch the weights into the node's cache, then back to zero.
        wake()
        to_zero()
        cached = next(p for p in cache.rglob(weights.name))

        llmgw_ready, llmgw_token = [], []
        for _ in range(options.runs):
            started = time.monotonic()
            replica = wake()
            ready = time.monotonic()
            token_at = first_token(replica.endpoint)
            llmgw_ready.append(ready - started)
            llmgw_token.append(token_at - started)
            to_zero()

        engine_ready, engine_token = [], []
        for _ in range(options.runs):
            port = engines.free_port()
            argv = engines.command("llamacpp", cached, port, ["--ctx-size", "2048"], model=MODEL)
            started = time.monotonic()
            process = engines.spawn(argv, work / "engine.log")
            until(lambda port=port: engines.answers(port, timeout=0.5), 180, "the engine", 0.02)
            ready = time.monotonic()
            token_at = first_token(f"http://127.0.0.1:{port}/v1")
            engine_ready.append(ready - started)
            engine_token.append(token_at - started)
            engines.stop_group(process.pid, grace=5)
            process.wait(timeout=10)
    finally:
        for entry in engine_state.read_state(cache)["replicas"].values() if cache.exists() else []:
            if entry.get("pid") and engines.group_alive(entry["pid"]):
                engines.stop_group(entry["pid"], grace=3)
        for process in reversed(processes):
            try:
                os.killpg(process.pid, 15)
                process.wait(timeout=15)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass

    cost = statistics.median(llmgw_token) - statistics.median(engine_token)
    print(f"wake, {options.runs} runs each, weights cached, on {os.cpu_count()} cores (work in {work}):")
    print(f"  llmgw   fleet.wake -> ready          {summary(llmgw_ready)}")
    print(f"  llmgw   fleet.wake -> first token    {summary(llmgw_token)}")
    print(f"  engine  start -> answers             {summary(engine_ready)}")
    print(f"  engine  start -> first token         {summary(engine_token)}")
    print(f"  llmgw's cost of waking (medians, to first token): {cost:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
