#!/usr/bin/env python
"""No errors during change: 16 clients streaming through the gateway while the only replica changes.

    .venv/bin/python bench/on_demand_change.py [--seconds 60] [--clients 16] [--quick]

The fleet of bench/fleetbench.py (the real agent, control worker, beat and admin servers)
serves SmolLM2-135M with fewest = most = 1. Two gateways read the same database: one as
shipped (requests held while no replica is ready, LLMGW_HOLD_S=300) and its peer with
LLMGW_HOLD_S=0 (today's behaviour before issue 14: 503 or 502 at once). For each gateway,
each change in turn, --clients clients stream short answers (16 tokens) for --seconds,
one request after another; a client that gets an error waits 0.1 s and asks again. A
quarter of the way in, the change:

  edit        the profile's arguments edited (a rolling replacement, fleet/placement.py
              _retire): room for both, so the old replica serves until the new one is
              ready, then is stopped
  edit-tight  the same with the profile asking for more than half the node's memory: the
              old replica is stopped first to make room, so the model has none ready
              until the new one has started (the widest gap an edit leaves)
  kill        the only replica's engine SIGKILLed; the agent starts it again (1 s backoff)

For every request sent after the change: its status (200 whole; 200 but the stream ended
with an error event; 503; 502; no answer) and its wait, from sending to the first token
(or to the error). --quick: 20 s a run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fleetbench import MODEL, LocalFleet, until  # noqa: E402
from harness import Goal, rotation, table  # noqa: E402
from harness import report as reported  # noqa: E402

HELD = "held (LLMGW_HOLD_S=300)"
# Issue 14: through the gateway as shipped, every request sent after a change is answered whole.
GOALS = [
    Goal(
        "no error during a change through the gateway as shipped (held)",
        lambda held: all(sum(c.values()) == c["200"] for c in held),
    )
]

ASK = {
    "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
    ],
    "max_tokens": 16,
    "temperature": 0,
    "stream": True,
}


def one_request(url: str, secret: str) -> tuple[float, str, float]:
    """(sent at, outcome, wait): the outcome "200", "200+error", "503", "502", ... or "no answer"."""
    sent = time.monotonic()
    wait = None
    try:
        with requests.post(
            url + "/v1/chat/completions",
            json={"model": MODEL, **ASK},
            headers={"Authorization": f"Bearer {secret}"},
            stream=True,
            timeout=330,
        ) as response:
            if response.status_code != 200:
                response.content  # noqa: B018 - read to the end
                return sent, str(response.status_code), time.monotonic() - sent
            errored = done = False
            for line in response.iter_lines(decode_unicode=True):
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    errored = True
                elif wait is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                    wait = time.monotonic() - sent
            outcome = "200+error" if errored or not done else "200"
            return sent, outcome, wait if wait is not None else time.monotonic() - sent
    except requests.RequestException:
        return sent, "no answer", time.monotonic() - sent


def clients(url: str, secret: str, count: int, seconds: float) -> list[tuple[float, str, float]]:
    results: list[tuple[float, str, float]] = []
    lock = threading.Lock()
    until_t = time.monotonic() + seconds

    def run():
        while time.monotonic() < until_t:
            result = one_request(url, secret)
            with lock:
                results.append(result)
            if result[1] != "200":
                time.sleep(0.1)

    threads = [threading.Thread(target=run, daemon=True) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def p99(values: list[float]) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[98]


class Served:
    """The model's one replica, and a run of clients through a gateway while it changes."""

    def __init__(self, fleet: LocalFleet, secret: str, profile, tight_memory_gb: int) -> None:
        self.fleet, self.secret, self.profile, self.tight_memory_gb = fleet, secret, profile, tight_memory_gb
        self.contexts = iter([1024, 2048] * 8)

    @staticmethod
    def settled():
        from fleet.models import Replica

        rows = list(Replica.objects.filter(model_name=MODEL))
        return rows[0] if len(rows) == 1 and rows[0].state == "ready" else None

    def change(self, change: str) -> None:
        if change == "kill":
            os.killpg(self.fleet.engine_pid(self.settled().pk), signal.SIGKILL)
        else:
            self.profile.args = ["--ctx-size", str(next(self.contexts))]
            self.profile.min_memory_gb = self.tight_memory_gb if change == "edit-tight" else 0
            self.profile.save()  # queues fleet.reconcile (fleet/signals.py)

    def through(self, change: str, label: str, url: str, count: int, seconds: float) -> tuple:
        """Clients through `url` for `seconds`, the change a quarter of the way in:
        (cut by it, sent after it, their outcomes counted, the waits of those answered)."""
        until(self.settled, 300, "one ready replica", 0.3)
        until(lambda: one_request(url, self.secret)[1] == "200", 60, "the gateway to route the model", 0.5)
        box = {}

        def change_now():
            time.sleep(seconds / 4)
            box["at"] = time.monotonic()
            self.change(change)

        changer = threading.Thread(target=change_now)
        changer.start()
        results = clients(url, self.secret, count, seconds)
        changer.join()
        after = [(outcome, wait) for sent, outcome, wait in results if sent >= box["at"]]
        # Sent before the change and cut by it (a stream whose engine died): not saved, by design.
        cut = sum(1 for sent, outcome, _ in results if sent < box["at"] and outcome != "200")
        counts = Counter(outcome for outcome, _ in after)
        waits = [wait for outcome, wait in after if outcome == "200"]
        print(
            f"{change:10s} {label:26s} sent {len(results):4d}, after the change {len(after):4d}: "
            + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
            + f"; before it, not whole: {cut}"
            + (f"; wait p50 {statistics.median(waits):.2f} s, p99 {p99(waits):.2f} s" if waits else ""),
            flush=True,
        )
        return cut, len(after), counts, waits


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="20 s a run")
    parser.add_argument("--changes", default="edit,edit-tight,kill")
    options = parser.parse_args()
    seconds = 20.0 if options.quick else options.seconds
    changes = options.changes.split(",")
    if bad := [c for c in changes if c not in ("edit", "edit-tight", "kill")]:
        parser.error(f"unknown change {bad[0]!r}: the changes are edit, edit-tight and kill")

    with LocalFleet("llmgw-bench-change-") as fleet:
        from catalog.models import Model, Profile
        from fleet.models import Node
        from gateway.keys import create_key

        gateways = {
            HELD: fleet.gateway("gateway-held"),
            "not held (LLMGW_HOLD_S=0)": fleet.gateway("gateway-nohold", LLMGW_HOLD_S="0"),
        }
        _, secret = create_key("bench")
        model = Model.objects.create(name=MODEL, source=fleet.source, context_length=2048, scaling_min=1, scaling_max=1)
        profile = Profile.objects.create(model=model, name="cpu", engine="llamacpp", args=["--ctx-size", "2048"])
        served = Served(fleet, secret, profile, Node.objects.get(name="n1").memory_gb // 2 + 1)
        report = []
        for round_, change in enumerate(changes):
            for label, url in rotation(list(gateways.items()), round_):
                report.append((change, label, *served.through(change, label, url, options.clients, seconds)))

    print(
        f"\n{options.clients} clients, {seconds:.0f} s a run, the change at {seconds / 4:.0f} s, "
        f"on {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} (work in {fleet.work})"
    )
    table(
        ["change", "gateway", "requests after the change", "200", "200, stream ended in error", "503", "502"]
        + ["other", "wait p50", "wait p99", "in flight at the change, not whole"],
        [
            (change, label, after, counts["200"], counts["200+error"], counts["503"], counts["502"])
            + (after - sum(counts[k] for k in ("200", "200+error", "503", "502")),)
            + (f"{statistics.median(waits):.2f} s" if waits else "-", f"{p99(waits):.2f} s", cut)
            for change, label, cut, after, counts, waits in report
        ],
    )
    held = [counts for _, label, _, after, counts, _ in report if label == HELD]
    reported(GOALS, held)
    return 0


if __name__ == "__main__":
    sys.exit(main())
