#!/usr/bin/env python
"""Prefix-aware routing against least-in-flight, on real replicas of the demo model, side by side in one run.

    .venv/bin/python bench/prefix.py [--replicas 2] [--slots 4] [--clients 8] [--conversations 16]
                                     [--turns 4] [--max-tokens 32] [--system-words 700]
                                     [--cache-ram MIB] [--bound 1.25] [--margin 1.25]
                                     [--modes prefix,load[,mean][,ring]]
                                     [--sticky-clients] [--skip-hot]

Each mode gets fresh replicas (llama-server as the agent starts it, `agent.engines.command`:
one thread each, --parallel SLOTS, the prompt cache on), behind one `manage.py gateway`
process on its own SQLite and a private redis-server, with its access log on:

  prefix  the model's routing profile `chat`: by the conversation's prefix, bounded by load
  mean    by prefix, bounded by the model's mean load alone (LLMGW_PREFIX_SLOT_MARGIN=0): the
          bound before issue 39, which spilled turns while their replica had free slots
  ring    by prefix, a conversation's first turn on its key's owner too (LLMGW_PREFIX_OPEN_BY_LOAD=false):
          before issue 39 placed new conversations by load
  load    the same model with routing profile `load`: the fewest requests in flight (as before)

Goals (issue 39), printed as "met" or "NOT met" against least-in-flight in the same run: first
token p50 at least 3× lower by prefix at the default bound, and tokens per second not lower.

16 conversations, each with a system prompt of its own of about 1,000 tokens, are played
by --clients concurrent clients, --turns turns each (a turn sends the whole conversation so
far, streamed; the answer is appended and a new question asked). As users of a chat
service do, a conversation's next turn comes after other conversations' requests: a client
takes the conversation at the front of the queue, plays its next turn and puts it at the
back. With --sticky-clients a client plays all of a conversation's turns back to back
instead, each the instant the last answer ended: in that closed loop least-in-flight sends
the next turn to the replica that has just become the least busy, the one that answered
the last turn, an affinity that no real user's think time keeps. Reported per mode: time to first
token p50 and p95, tokens per second in total (prompt and completion tokens the engines
counted, and completion tokens alone), the cache hit rate (the prompt tokens the engines
took from their cache ÷ all prompt tokens), and the requests each replica answered.

Then the hot prefix, routed by prefix: half the requests are one opening that many clients
send (the same system prompt and first question), the other half the conversations as
above. From the access log (each request's start, end, replica and route) it checks, at
every request's start, that the replica chosen had no more requests in flight than the
bound: the larger of ceil(LLMGW_PREFIX_SLOT_MARGIN × slots) and
ceil(LLMGW_PREFIX_LOAD_BOUND × (the model's requests in flight + 1) ÷ replicas).

--cache-ram passes llama-server's host-memory prompt cache size (MiB; 0 turns it off);
left out, the bound the control plane starts a replica with (`catalog.memory.prompt_cache_args`:
one pool's KV cache again, from the model's header) is what is used, as a replica of it runs.
Only loopback is used.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import requests
from harness import ROOT, Goal, Servers, Site, free_port, report, table, until

sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")

import django  # noqa: E402

django.setup()

from agent import engines  # noqa: E402
from catalog.memory import prompt_cache_args  # noqa: E402
from launcher import smollm2  # noqa: E402
from mirror.headers import read_version  # noqa: E402

TOPICS = [
    "rivers", "castles", "violins", "glaciers", "bakeries", "lighthouses", "orchards", "comets",
    "deserts", "libraries", "trains", "volcanoes", "gardens", "harbours", "bridges", "forests",
]  # fmt: skip
QUESTIONS = [
    "Tell me one fact.",
    "Why is that?",
    "Say it more simply.",
    "Give an example.",
    "What else should I know?",
    "Sum it up in five words.",
]


def system_prompt(n: int, words: int) -> str:
    """About 1.4 tokens a word on SmolLM2's tokenizer: 700 words is about 1,000 tokens. Different from the start."""
    topic = TOPICS[n % len(TOPICS)]
    out = [f"Conversation {n}: you are a patient guide to {topic}."]
    i = 0
    while sum(len(s.split()) for s in out) < words:
        out.append(f"Rule {i} for {topic}: answer briefly, name one detail about {topic}, and stay kind.")
        i += 1
    return " ".join(out)


class Run:
    """The gateway, its database and Redis, and the replicas of the mode being measured."""

    def __init__(self, servers: Servers, options) -> None:
        self.servers, self.options, self.work = servers, options, servers.work
        _, redis_port = servers.redis()
        self.site = Site(
            servers,
            "gateway",
            redis_port=redis_port,
            LLMGW_GATEWAY_REFRESH_MS="200",
            LLMGW_PREFIX_LOAD_BOUND=str(options.bound),
            LLMGW_PREFIX_SLOT_MARGIN=str(options.margin),
            # The hit rate is read from usage.prompt_tokens_details, which clients see as 0 unless
            # the operator shows it (docs/gateway.md, "What clients see of the prompt cache").
            LLMGW_GATEWAY_SHOW_CACHED_TOKENS="true",
        )
        self.key = self.site.create_key("bench")
        self.gateway: subprocess.Popen | None = None
        self.engines: list[subprocess.Popen] = []

    def start_engines(self, name: str) -> list[int]:
        o = self.options
        args = ["--ctx-size", str(o.slots * 2048), "--parallel", str(o.slots), "--threads", "1", *o.engine_args.split()]
        if o.cache_ram is not None:
            args += ["--cache-ram", str(o.cache_ram)]
        else:
            args += prompt_cache_args("llamacpp", read_version({smollm2.FILE: smollm2.gguf_path()}), args)
        ports, started = [], []
        for n in range(o.replicas):
            port = free_port()
            argv = engines.command("llamacpp", smollm2.gguf_path(), port, args, model=smollm2.MODEL)
            log = self.work / f"{name}-engine{n}.log"
            process = self.servers.adopt(engines.spawn(argv, log, engines.engine_env("llamacpp", "")))
            started.append((process, port, log))
            ports.append(port)
        for process, port, log in started:
            if not engines.wait_until_answers(process, port, timeout=300):
                raise SystemExit(f"an engine did not answer (exit {process.poll()}):\n{engines.last_lines(log)}")
            self.engines.append(process)
        print(f"llama-server: {' '.join(argv)}", flush=True)
        return ports

    def stop_engines(self) -> None:
        for process in self.engines:
            self.servers.stop(process, grace=5)
        self.engines = []

    def serve(self, model: str, routing: str, ports: list[int]) -> None:
        model_fields = dict(source="http://127.0.0.1:1/m/v1/", context_length=2048, routing_profile=routing)
        endpoints = [f"http://127.0.0.1:{port}/v1" for port in ports]
        profile_fields = dict(parallel=self.options.slots)
        self.site.route(
            [dict(model=model, endpoints=endpoints, model_fields=model_fields, profile_fields=profile_fields)]
        )

    def start_gateway(self, log: Path, **more: str) -> str:
        if self.gateway is not None:
            self.servers.stop(self.gateway, grace=5)
        self.gateway = self.site.start(LLMGW_GATEWAY_ACCESS_LOG=str(log), **more)
        return self.site.url

    def wait_routed(self, url: str, model: str) -> None:
        def routed() -> bool:
            try:
                listed = requests.get(url + "/models", headers=self.headers, timeout=2)
                return listed.status_code == 200 and any(m["id"] == model and m["ready"] for m in listed.json()["data"])
            except requests.RequestException:
                return False

        until(routed, 60, f"the gateway to route {model} ({self.work}/gateway.log says why if it does not)", 0.3)

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.key}"}


def stream(url: str, headers: dict, model: str, messages: list[dict], max_tokens: int) -> dict:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "seed": 1,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    first = None
    text, usage = [], None
    with requests.post(url + "/chat/completions", json=body, headers=headers, stream=True, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"status {r.status_code}: {r.text[:300]}")
        replica = int(r.headers.get("x-llmgw-replica", 0))
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    if first is None:
                        first = time.perf_counter() - started
                    text.append(content)
            if chunk.get("usage"):
                usage = chunk["usage"]
    usage = usage or {}
    return {
        "ttft": first if first is not None else time.perf_counter() - started,
        "text": "".join(text),
        "prompt": usage.get("prompt_tokens", 0),
        "completion": usage.get("completion_tokens", 0),
        "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
        "replica": replica,
    }


def streamed(url: str, headers: dict, model: str, messages: list, max_tokens: int, kept: tuple, **where) -> str:
    """One streamed request: its figures kept with `where` in `kept`'s results, or its error; its text ('' if none)."""
    lock, results, errors = kept
    try:
        r = stream(url, headers, model, messages, max_tokens)
    except Exception as error:
        with lock:
            errors.append(str(error))
        return ""
    with lock:
        results.append(dict(r, **where))
    return r["text"]


def play(url: str, headers: dict, model: str, options, hot_share: float = 0.0) -> dict:
    """The clients playing the conversations; with hot_share, that share of requests is one hot opening instead."""
    prompts = [system_prompt(n, options.system_words) for n in range(options.conversations)]
    waiting: queue.Queue = queue.Queue()
    for n in range(options.conversations):
        waiting.put((n, [{"role": "system", "content": prompts[n]}], 0))
    # What the clients draw: one draw a turn (or, sticky, a whole conversation).
    left = {"plays": options.conversations * (1 if options.sticky_clients else options.turns), "hot": 0}
    requests = options.conversations * options.turns
    hot_target = int(requests * hot_share / (1 - hot_share)) if hot_share else 0
    results, errors = [], []
    lock = threading.Lock()
    kept = (lock, results, errors)
    hot_messages = [
        {"role": "system", "content": system_prompt(999, options.system_words)},
        {"role": "user", "content": "Say hello to the many."},
    ]

    def client(i: int) -> None:
        while True:
            with lock:
                want_hot = left["hot"] < hot_target and (left["plays"] <= 0 or (i + left["hot"]) % 2 == 0)
                if want_hot:
                    left["hot"] += 1
                elif left["plays"] > 0:
                    left["plays"] -= 1
                else:
                    return
            if want_hot:
                streamed(url, headers, model, hot_messages, options.max_tokens, kept, conversation="hot", turn=0)
                continue
            n, messages, first = waiting.get()
            # One turn, and the conversation goes to the back of the queue for whichever client is free
            # next; sticky, this client plays the rest of its turns back to back.
            last = options.turns if options.sticky_clients else first + 1
            for turn in range(first, last):
                messages = [*messages, {"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]}]
                text = streamed(url, headers, model, messages, options.max_tokens, kept, conversation=n, turn=turn)
                messages = [*messages, {"role": "assistant", "content": text}]
            if last < options.turns:
                waiting.put((n, messages, last))

    started = time.monotonic()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(options.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"results": results, "errors": errors, "seconds": time.monotonic() - started}


def summary(label: str, played: dict) -> dict:
    results = played["results"]
    ttft = sorted(r["ttft"] for r in results)
    prompt = sum(r["prompt"] for r in results)
    cached = sum(r["cached"] for r in results)
    completion = sum(r["completion"] for r in results)
    by_replica: dict[int, int] = {}
    for r in results:
        by_replica[r["replica"]] = by_replica.get(r["replica"], 0) + 1
    return {
        "label": label,
        "requests": len(results),
        "errors": len(played["errors"]),
        "p50": statistics.median(ttft) * 1000 if ttft else 0,
        # The turns a cache can serve (a conversation's first turn is computed whatever the routing).
        "p50_later": statistics.median(later) * 1000 if (later := [r["ttft"] for r in results if r["turn"]]) else 0,
        "p95": ttft[min(len(ttft) - 1, math.ceil(0.95 * len(ttft)) - 1)] * 1000 if ttft else 0,
        "tokens_s": (prompt + completion) / played["seconds"],
        "completion_s": completion / played["seconds"],
        "hit": 100 * cached / prompt if prompt else 0,
        "prompt_mean": prompt / len(results) if results else 0,
        "seconds": played["seconds"],
        "by_replica": dict(sorted(by_replica.items())),
    }


def over_the_bound(log: Path, model: str, options) -> tuple[int, int, int, dict]:
    """(requests checked, requests that found their replica over the bound, the most in flight on one replica, routes)."""
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    lines = [line for line in lines if line.get("model") == model and line.get("replica")]
    spans = [(line["ts"] - line["duration_ms"] / 1000, line["ts"], line["replica"], line["route"]) for line in lines]
    checked = over = most = 0
    routes: dict[str, int] = {}
    for start, _, replica, route in spans:
        routes[route] = routes.get(route, 0) + 1
        # In flight when this one began: begun before it and not yet ended (this one excluded).
        others = [(s, e, r) for s, e, r, _ in spans if s < start < e]
        total = len(others)
        mine = sum(1 for _, _, r in others if r == replica) + 1
        most = max(most, mine)
        checked += 1
        bound = max(
            math.ceil(options.margin * options.slots), math.ceil(options.bound * (total + 1) / options.replicas)
        )
        if mine > bound:
            over += 1
    return checked, over, most, routes


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--system-words", type=int, default=700)
    parser.add_argument("--cache-ram", type=int, default=None)
    parser.add_argument("--bound", type=float, default=1.25, help="LLMGW_PREFIX_LOAD_BOUND for the gateway")
    parser.add_argument("--margin", type=float, default=1.25, help="LLMGW_PREFIX_SLOT_MARGIN for the gateway")
    parser.add_argument("--modes", default="prefix,load", help="which of prefix, mean, ring and load to measure")
    parser.add_argument("--skip-hot", action="store_true")
    parser.add_argument("--engine-args", default="", help="more llama-server arguments, as a profile's args (quoted)")
    parser.add_argument(
        "--sticky-clients",
        action="store_true",
        help="each client plays a conversation's turns back to back (see the module's docstring)",
    )
    options = parser.parse_args()
    if not 2 <= options.replicas:
        raise SystemExit("--replicas must be at least 2: routing among one replica is no choice")

    with Servers("llmgw-bench-prefix-", keep=True) as servers:
        run = Run(servers, options)
        rows = contend(run, options)
        print_rows(rows, options)
        if not options.skip_hot:
            hot_prefix(run, options)
    return 0


def contend(run: Run, options) -> list[dict]:
    """Each mode on fresh replicas behind the gateway, one after the other: a row each."""
    modes = [m.strip() for m in options.modes.split(",")]
    contenders = (
        ("prefix", "chat", f"prefix, slots × {options.margin:g} or mean × {options.bound:g}", {}),
        ("mean", "chat", f"prefix, mean × {options.bound:g} alone", {"LLMGW_PREFIX_SLOT_MARGIN": "0"}),
        ("ring", "chat", "prefix, first turns by hash", {"LLMGW_PREFIX_OPEN_BY_LOAD": "false"}),
        ("load", "load", "least in flight", {}),
    )
    rows = []
    for mode, routing, label, more in contenders:
        if mode not in modes:
            continue
        model = f"smollm2-{mode}"
        ports = run.start_engines(mode)
        run.serve(model, routing, ports)
        url = run.start_gateway(run.work / f"access-{mode}.log", **more)
        run.wait_routed(url, model)
        before = load_average()
        played = play(url, run.headers, model, options)
        row = summary(label, played)
        row["load"] = f"{before} → {load_average()}"
        rows.append(row)
        print(f"{label}: {json.dumps(row)}", flush=True)
        if routing == "chat":
            _, over, most, routes = over_the_bound(run.work / f"access-{mode}.log", model, options)
            print(f"  routes {routes}; over the bound {over}, the most in flight on one replica {most}", flush=True)
        if played["errors"]:
            print(f"  errors, the first: {played['errors'][0]}", flush=True)
        run.stop_engines()
    return rows


def print_rows(rows: list[dict], options) -> None:
    cache_ram = options.cache_ram if options.cache_ram is not None else "as the control plane bounds it"
    print(
        f"\n{options.replicas} replicas of {smollm2.MODEL} (one thread, {options.slots} slots each"
        f", --cache-ram {cache_ram}), {options.conversations} conversations × {options.turns} turns, "
        f"{options.clients} clients, answers of {options.max_tokens} tokens, prompts of "
        f"{rows[0]['prompt_mean']:.0f} tokens on average\n"
    )
    table(
        ["routing", "requests", "first token p50", "p95", "later turns' p50", "tokens/s (prompt + completion)"]
        + ["completion tokens/s", "cache hit rate", "requests per replica", "wall", "load average (before → after)"],
        [
            (r["label"], f"{r['requests']}" + (f" ({r['errors']} errors)" if r["errors"] else ""))
            + (f"{r['p50']:.0f} ms", f"{r['p95']:.0f} ms", f"{r['p50_later']:.0f} ms", f"{r['tokens_s']:.0f}")
            + (f"{r['completion_s']:.1f}", f"{r['hit']:.0f}%", " / ".join(str(v) for v in r["by_replica"].values()))
            + (f"{r['seconds']:.0f} s", r["load"])
            for r in rows
        ],
    )
    load = next((r for r in rows if r["label"] == "least in flight"), None)
    if load is None or not load["p50"]:
        return
    figures = {r["label"]: r for r in rows}
    for r in rows:
        if r is load:
            continue
        lower = load["p50"] / max(r["p50"], 1e-9)
        print(
            f"\n{r['label']}: first token p50 {lower:.1f}× lower than least in flight, tokens/s "
            f"{r['tokens_s'] / max(load['tokens_s'], 1e-9):.2f}×; the later turns' p50 "
            f"{load['p50_later'] / max(r['p50_later'], 1e-9):.1f}× lower",
            flush=True,
        )
        report(goals(r["label"]), figures)


def goals(label: str) -> list[Goal]:
    """Issue 39's goals for a prefix contender, against least in flight in the same run."""
    return [
        Goal(
            f"{label}: first token p50 ≥ 3× lower than least in flight, tokens/s not lower",
            lambda f: f["least in flight"]["p50"] / max(f[label]["p50"], 1e-9) >= 3
            and f[label]["tokens_s"] >= f["least in flight"]["tokens_s"],
        )
    ]


def hot_prefix(run: Run, options) -> None:
    """Half the requests one opening, routed by prefix: no replica chosen over the bound."""
    ports = run.start_engines("hot")
    run.serve("smollm2-hot", "chat", ports)
    log = run.work / "access-hot.log"
    url = run.start_gateway(log)
    run.wait_routed(url, "smollm2-hot")
    before = load_average()
    played = play(url, run.headers, "smollm2-hot", options, hot_share=0.5)
    row = summary("hot prefix", played)
    checked, over, most, routes = over_the_bound(log, "smollm2-hot", options)
    hot = [r for r in played["results"] if r["conversation"] == "hot"]
    hot_by_replica: dict[int, int] = {}
    for r in hot:
        hot_by_replica[r["replica"]] = hot_by_replica.get(r["replica"], 0) + 1
    print(
        f"\nhot prefix: {len(hot)} of {row['requests']} requests one opening; its requests per replica "
        f"{dict(sorted(hot_by_replica.items()))}; routes {routes}; first token p50 {row['p50']:.0f} ms, "
        f"p95 {row['p95']:.0f} ms; cache hit rate {row['hit']:.0f}%; at {checked} request starts, "
        f"{over} found their replica over the bound (most in flight on one replica: {most}); "
        f"load average {before} → {load_average()}",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
