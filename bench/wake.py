#!/usr/bin/env python
"""Waking a model at zero replicas, weights cached: llmgw's path against the engine's own start.

    .venv/bin/python bench/wake.py [--runs 5] [--from request|task]

On this machine, the fleet of bench/fleetbench.py without its beat: a Redis, the byte
listener, a control worker (Celery, queue `control`), one agent (`manage.py agent`, with
its engine supervisor) and a gateway (`manage.py gateway`, as
shipped: its table re-read every second, ten times a second while requests wait), on
SmolLM2-135M-Instruct Q4_1 (launcher/smollm2.py). The model is served with fewest 0 and
most 1, woken once so the node caches its weights, and taken back to zero. Then,
`--runs` times each:

  llmgw    --from request (the default): a client's streamed chat request through the
           gateway, for the model at zero -> held, the gateway sends `fleet.wake` ->
           the reconcile pass places a replica -> the agent starts the engine -> the
           replica is reported ready -> the gateway's table has it -> the request is let
           go -> the first streamed token reaches the client. (The time the replica was
           reported ready in the database is noted on the way.)
           --from task: `fleet.wake` sent by hand on the control queue -> the replica
           reported ready -> the first streamed token, asked of the engine directly
           (with the replica's secret); the gateway's hold is not in this path.
  engine   the same engine started by hand (`agent.engines.command` and `spawn`, the
           agent's own argument list) on the cached file -> it answers /v1/models
           (asked every 20 ms) -> the first streamed token

The difference is what waking costs llmgw: the hold, the task, the reconcile pass, the
start message, the agent's cache check, the supervisor's loop, the ready report, the
gateway seeing it. Only loopback.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fleetbench import MODEL, LocalFleet, until  # noqa: E402
from harness import Goal, report, side_by_side  # noqa: E402

ASK = {
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "max_tokens": 8,
    "temperature": 0,
    "stream": True,
}


def first_token(endpoint: str, headers: dict[str, str] | None = None) -> float:
    """When the first streamed token of a short answer arrived (monotonic)."""
    body = {"model": MODEL, **ASK}
    with requests.post(endpoint + "/chat/completions", json=body, headers=headers, stream=True, timeout=400) as r:
        r.raise_for_status()
        for line in r.iter_lines(decode_unicode=True):
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                    return time.monotonic()
    raise SystemExit(f"{endpoint} streamed no token")


def summary(values: list[float]) -> str:
    return f"median {statistics.median(values):.2f} s (min {min(values):.2f}, max {max(values):.2f})"


GOAL_S = 0.5  # issue 39
GOALS = [Goal(f"a wake costs at most {GOAL_S} s over the engine's own start to the first token", lambda c: c <= GOAL_S)]
STEPS = (
    ("placed", "request -> replica placed (its row)"),
    ("spawned", "placed -> engine process started"),
    ("answers", "engine started -> engine answers"),
    ("ready", "engine answers -> replica reported ready"),
    ("token", "reported ready -> first token at the client"),
)


class Steps(threading.Thread):
    """When each step of one wake happened, in wall-clock seconds, seen from outside every process.

    The replica's row (`created`, and `since` once ready) is read from the database; the engine's
    process is found by psutil (when first seen, looked for every 10 ms); its health check is asked every 10 ms.
    """

    def __init__(self, model: str, known: set[int], engine_pids: set[int]) -> None:
        super().__init__(daemon=True)
        self.model, self.known, self.engine_pids = model, known, engine_pids
        self.at: dict[str, float] = {}
        self.done = threading.Event()

    def run(self) -> None:
        import psutil

        from agent import engines
        from fleet.models import Replica

        port = None
        while not self.done.is_set() and len(self.at) < 4:
            if "placed" not in self.at:
                row = Replica.objects.filter(model_name=self.model).exclude(pk__in=self.known).first()
                if row:
                    self.at["placed"] = row.created.timestamp()
            if "spawned" not in self.at:
                for process in psutil.process_iter(["name", "cmdline"]):
                    if process.info["name"] == "llama-server" and process.pid not in self.engine_pids:
                        argv = process.info["cmdline"] or []
                        port = int(argv[argv.index("--port") + 1])
                        # When first seen, not psutil's create_time: that counts from the boot time,
                        # which drifts from the wall clock (half a second here).
                        self.at["spawned"] = time.time()
                        break
            if port and "answers" not in self.at and engines.answers(port, timeout=0.5):
                self.at["answers"] = time.time()
            if "ready" not in self.at:
                row = Replica.objects.filter(model_name=self.model, state="ready").exclude(pk__in=self.known).first()
                if row:
                    self.at["ready"] = row.since.timestamp()
            time.sleep(0.01)


def engine_pids() -> set[int]:
    import psutil

    return {p.pid for p in psutil.process_iter(["name"]) if p.info["name"] == "llama-server"}


class Wake:
    """The model at zero on the fleet, and the two ways of bringing it up that are compared."""

    def __init__(self, fleet: LocalFleet, origin: str) -> None:
        from catalog.models import Model, Profile
        from gateway.keys import create_key

        self.fleet, self.origin = fleet, origin
        self.gateway = fleet.gateway() + "/v1"
        _, secret = create_key("bench")
        self.headers = {"Authorization": f"Bearer {secret}"}
        model = Model.objects.create(
            name=MODEL, source=fleet.source, context_length=2048, scaling_min=0, scaling_max=1, idle_s=2
        )
        Profile.objects.create(model=model, name="cpu", engine="llamacpp", args=["--ctx-size", "2048"])
        self.steps: list[dict[str, float]] = []
        # Once to fetch the weights into the node's cache, then back to zero.
        first_token(self.gateway, self.headers)
        self.to_zero()
        self.cached = next(p for p in fleet.cache.rglob(fleet.weights.name))

    @staticmethod
    def ready_replica():
        from fleet.models import Replica

        return until(
            lambda: Replica.objects.filter(model_name=MODEL, state="ready").select_related("node").first(), 300, "ready"
        )

    def to_zero(self) -> None:
        from agent import engine_state
        from fleet import reconcile
        from fleet.models import Replica

        # Its idle time (2 s here) does it, in passes as the beat runs them, once the gateway's
        # load (written once a second) says the last request is done.
        until(lambda: reconcile.reconcile() and not Replica.objects.exists(), 90, "the replica to stop", 0.5)
        until(lambda: not engine_state.running_engines(self.fleet.cache), 60, "the engine to stop")
        time.sleep(2)  # the gateway's table (re-read every second) has no replica either

    def llmgw(self) -> tuple[float, float]:
        """(reported ready, first token) from the wake's start; then back to zero."""
        ready_and_token = (self.through_the_gateway if self.origin == "request" else self.by_task)()
        self.to_zero()
        return ready_and_token

    def through_the_gateway(self) -> tuple[float, float]:
        """(reported ready, first token) after a request for the model at zero, from its sending."""
        from fleet.models import Replica

        watch = Steps(MODEL, set(Replica.objects.values_list("pk", flat=True)), engine_pids())
        watch.start()
        wall = time.time()
        started = time.monotonic()
        box = {}
        client = threading.Thread(target=lambda: box.setdefault("token", first_token(self.gateway, self.headers)))
        client.start()
        self.ready_replica()
        ready = time.monotonic()
        client.join(400)
        watch.done.set()
        watch.join(5)
        if "token" not in box:
            raise SystemExit("the request through the gateway was not answered")
        watch.at["token"] = wall + box["token"] - started
        at, before = {}, wall
        for name, _ in STEPS:
            if name in watch.at:
                at[name] = watch.at[name] - before
                before = watch.at[name]
        self.steps.append(at)
        return ready - started, box["token"] - started

    def by_task(self) -> tuple[float, float]:
        from celery import current_app

        from contracts import credentials, demand, tasks

        started = time.monotonic()
        current_app.send_task(demand.WAKE, args=[MODEL], queue=tasks.CONTROL_QUEUE)
        replica = self.ready_replica()
        ready = time.monotonic()
        nonce = credentials.replica_nonce(replica.created)
        own = credentials.bearer(credentials.replica_secret(replica.node.token_hash, replica.pk, nonce))
        return ready - started, first_token(replica.endpoint, own) - started

    def engine(self) -> tuple[float, float]:
        """The same engine started by hand on the cached file: (answers, first token) from its start."""
        from agent import engines

        port = engines.free_port()
        argv = engines.command("llamacpp", self.cached, port, ["--ctx-size", "2048"], model=MODEL)
        started = time.monotonic()
        process = self.fleet.servers.adopt(engines.spawn(argv, self.fleet.work / "engine.log"))
        until(lambda: engines.answers(port, timeout=0.5), 180, "the engine", 0.02)
        ready = time.monotonic()
        token_at = first_token(f"http://127.0.0.1:{port}/v1")
        self.fleet.servers.stop(process, grace=5)
        return ready - started, token_at - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--from", dest="origin", choices=("request", "task"), default="request")
    options = parser.parse_args()
    with LocalFleet("llmgw-bench-wake-", beat=False) as fleet:
        wake = Wake(fleet, options.origin)
        runs = side_by_side({"llmgw": wake.llmgw, "engine": wake.engine}, options.runs)
    llmgw_ready, llmgw_token = [r for r, _ in runs["llmgw"]], [t for _, t in runs["llmgw"]]
    engine_ready, engine_token = [r for r, _ in runs["engine"]], [t for _, t in runs["engine"]]

    start = "a request through the gateway" if options.origin == "request" else "fleet.wake sent"
    cost = statistics.median(llmgw_token) - statistics.median(engine_token)
    print(
        f"wake, {options.runs} runs each, weights cached, on {os.cpu_count()} cores, "
        f"load average {os.getloadavg()[0]:.1f} (work in {fleet.work}):"
    )
    print(f"  llmgw   {start} -> replica reported ready   {summary(llmgw_ready)}")
    print(f"  llmgw   {start} -> first token             {summary(llmgw_token)}")
    print(f"  engine  start -> answers                   {summary(engine_ready)}")
    print(f"  engine  start -> first token               {summary(engine_token)}")
    print(f"  llmgw's cost of waking (medians, to first token): {cost:.2f} s")
    if wake.steps:
        print("  each step of llmgw's wake (medians of the runs; each from the step before):")
        for name, said in STEPS:
            values = [at[name] for at in wake.steps if name in at]
            if values:
                print(f"    {said:<46} {summary(values)}")
    report(GOALS, cost)
    return 0


if __name__ == "__main__":
    sys.exit(main())
