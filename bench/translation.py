#!/usr/bin/env python
"""What translation costs: /v1/messages and /v1/responses against a plain chat request, through llmgw.

    .venv/bin/python bench/translation.py [--rounds 2000]

Starts bench/stub_upstream.py and llmgw's admin server as bench/gateway.py does
(its own database under a temporary directory), then sends, one at a time on
kept-alive connections and taking turns, the same question as a chat completion,
as an Anthropic message and as an OpenAI response; whole, then streamed (20 chunks
from the stub, translated event by event). The added cost of a translation is its
p50 minus the plain chat's p50 through the same gateway, and the same for the
gateway's own Server-Timing. The goal is the issue's: under 0.5 ms at p50 for
/v1/messages.
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
from dataclasses import dataclass
from pathlib import Path

import uvloop
from benchlib import ROOT, free_port
from httpload import Target, pct, sequential

# bench/gateway.py, the benchmark beside this one (this directory comes first on sys.path).
from gateway import answers, quiet_popen, start_llmgw

ADDED_P50_MS = 0.5


@dataclass
class ResponsesTarget(Target):
    def request(self, stream: bool = False, hold: bool = False) -> bytes:
        payload = {"model": self.model, "input": "Say hello.", "max_output_tokens": 20}
        if stream:
            payload["stream"] = True
        body = json.dumps(payload).encode()
        head = (
            f"POST {self.path} HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\n"
            f"Authorization: Bearer {self.key}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        return head.encode() + body


async def measure(chat: Target, translated: list[Target], rounds: int) -> dict:
    figures = {}
    for stream in (False, True):
        result = await sequential([chat, *translated], rounds, stream=stream)
        for t in translated:
            added = (pct(result.seconds[t.name], 50) - pct(result.seconds[chat.name], 50)) * 1000
            gateway = statistics.median(result.gateway_ms[t.name]) - statistics.median(result.gateway_ms[chat.name])
            first = (
                (pct(result.first_event[t.name], 50) - pct(result.first_event[chat.name], 50)) * 1000 if stream else 0.0
            )
            figures[(t.name, stream)] = (
                pct(result.seconds[chat.name], 50) * 1000,
                pct(result.seconds[t.name], 50) * 1000,
                added,
                gateway,
                first,
                result.errors[t.name],
            )
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--rounds", type=int, default=2000, help="requests one at a time, each kind")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="llmgw-bench-translation-"))
    processes: list[subprocess.Popen] = []
    try:
        stub_port = free_port()
        stub = quiet_popen(
            [sys.executable, str(ROOT / "bench" / "stub_upstream.py"), "--port", str(stub_port)],
            dict(os.environ),
            work / "stub.log",
        )
        processes.append(stub)
        started = start_llmgw(stub_port, work)
        if started is None:
            raise SystemExit("this tree has no gateway")
        processes.append(started[0])
        llmgw = started[1][0]  # the key without limits
        chat = Target("chat", llmgw.port, key=llmgw.key)
        messages = Target("messages", llmgw.port, key=llmgw.key, path="/v1/messages")
        responses = ResponsesTarget("responses", llmgw.port, key=llmgw.key, path="/v1/responses")

        async def run() -> dict:
            if not await answers(chat):
                raise SystemExit(f"llmgw did not answer\n{(work / 'llmgw.log').read_text(errors='replace')[-2000:]}")
            return await measure(chat, [messages, responses], args.rounds)

        figures = uvloop.run(run())
        print(f"\n{args.rounds} requests each, one at a time, taking turns with a plain chat request\n")
        print(
            f"{'':28}{'chat p50':>12}{'its p50':>12}{'added p50':>12}{'Server-Timing added':>22}"
            f"{'first event added':>20}{'errors':>8}"
        )
        for (name, stream), (base, own, added, gateway, first, errors) in figures.items():
            label = f"/v1/{name}" + (", streamed" if stream else "")
            first_text = f"{first:>18.3f}ms" if stream else f"{'':>20}"
            print(f"{label:28}{base:>10.3f}ms{own:>10.3f}ms{added:>10.3f}ms{gateway:>20.3f}ms{first_text}{errors:>8}")
        added = figures[("messages", False)][2]
        print(f"\n{'met    ' if added < ADDED_P50_MS else 'NOT met'}  /v1/messages adds under {ADDED_P50_MS} ms at p50")
        print(f"{os.cpu_count()} cores; load average: {os.getloadavg()[0]:.2f}")
    finally:
        for process in processes:
            try:
                os.killpg(process.pid, 15)
                process.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(process.pid, 9)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
