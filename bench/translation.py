#!/usr/bin/env python
"""What translation costs: /v1/messages and /v1/responses against a plain chat request, through llmgw.

    .venv/bin/python bench/translation.py [--rounds 2000]

Starts bench/stub_upstream.py and llmgw's gateway as bench/gateway.py does (its own
database under a temporary directory), then sends, one at a time on kept-alive
connections and taking turns, the same question as a chat completion, as an Anthropic
message and as an OpenAI response; whole, then streamed (20 chunks from the stub,
translated event by event). The added cost of a translation is its p50 minus the plain
chat's p50 through the same gateway, and the same for the gateway's own Server-Timing.
The goal is the issue's: under 0.5 ms at p50 for /v1/messages.
"""

from __future__ import annotations

import argparse
import os
import statistics
from dataclasses import dataclass

import uvloop
from harness import Goal, Servers, report, stub_site, table
from httpload import Target, answers, pct, sequential

ADDED_P50_MS = 0.5
GOALS = [
    Goal(f"/v1/messages adds under {ADDED_P50_MS} ms at p50", lambda f: f[("messages", False)]["added"] < ADDED_P50_MS)
]


@dataclass
class MessagesTarget(Target):
    def payload(self, stream: bool, hold: bool) -> dict:
        # Anthropic's messages have no stream_options: the gateway refuses a field it would not pass on.
        payload = super().payload(stream, hold)
        payload.pop("stream_options", None)
        return payload


@dataclass
class ResponsesTarget(Target):
    def payload(self, stream: bool, hold: bool) -> dict:
        payload = {"model": self.model, "input": "Say hello.", "max_output_tokens": 20}
        if stream:
            payload["stream"] = True
        return payload


async def measure(chat: Target, translated: list[Target], rounds: int) -> dict:
    """Per (kind, streamed): the chat's p50 and its own, what it adds, in Server-Timing and to the first event."""
    figures = {}
    for stream in (False, True):
        result = await sequential([chat, *translated], rounds, stream=stream)

        def p50(name: str, of: dict) -> float:
            return pct(of[name], 50) * 1000

        for t in translated:
            figures[(t.name, stream)] = {
                "chat": p50(chat.name, result.seconds),
                "own": p50(t.name, result.seconds),
                "added": p50(t.name, result.seconds) - p50(chat.name, result.seconds),
                "gateway": statistics.median(result.gateway_ms[t.name])
                - statistics.median(result.gateway_ms[chat.name]),
                "first": p50(t.name, result.first_event) - p50(chat.name, result.first_event) if stream else None,
                "errors": result.errors[t.name],
            }
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--rounds", type=int, default=2000, help="requests one at a time, each kind")
    args = parser.parse_args()
    with Servers("llmgw-bench-translation-") as servers:
        _, stub_port = servers.stub()
        site = stub_site(servers, stub_port)
        if site is None:
            raise SystemExit("this tree has no gateway")
        key = site.create_key("bench")
        site.start()
        chat = Target("chat", site.port, key=key)
        messages = MessagesTarget("messages", site.port, key=key, path="/v1/messages")
        responses = ResponsesTarget("responses", site.port, key=key, path="/v1/responses")

        async def run() -> dict:
            if not await answers(chat):
                raise SystemExit(f"llmgw did not answer\n{servers.log_tail(site.name)}")
            return await measure(chat, [messages, responses], args.rounds)

        figures = uvloop.run(run())
    print(f"\n{args.rounds} requests each, one at a time, taking turns with a plain chat request\n")
    table(
        ["", "chat p50", "its p50", "added p50", "Server-Timing added", "first event added", "errors"],
        [
            (
                f"/v1/{name}" + (", streamed" if stream else ""),
                f"{f['chat']:.3f} ms",
                f"{f['own']:.3f} ms",
                f"{f['added']:.3f} ms",
                f"{f['gateway']:.3f} ms",
                f"{f['first']:.3f} ms" if stream else "",
                f["errors"],
            )
            for (name, stream), f in figures.items()
        ],
    )
    print()
    report(GOALS, figures)
    print(f"{os.cpu_count()} cores; load average: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
