#!/usr/bin/env python
"""llama.cpp on the real demo model: through the gateway, the same llama-server direct, and the old Python server.

    .venv/bin/python bench/engine.py [--duration 30] [--streams 1,4,16,32] [--max-tokens 64]
                                     [--slots 16] [--threads 2] [--old-python PYTHON] [--engine-cpus 0]

One replica of SmolLM2-135M-Instruct Q4_1 (launcher/smollm2.py), side by side in one run:

  gateway   llama-server as the agent starts it (`agent.engines.command` and `spawn`:
            --parallel SLOTS over a pool of SLOTS x 512, --threads, --metrics), behind
            `manage.py gateway` with a key and a Redis of its own, as a client of `make run` sees it
  direct    the same binary with the same arguments, asked directly
  old       PyPI's llama-cpp-python server (`python -m llama_cpp.server`, --interrupt_requests
            false, one answer at a time), as the agent ran it before: only when
            --old-python names an interpreter that has llama-cpp-python[server] installed
            (the wheel is no longer built by `make`; say which venv), else left out and said so

For each, N clients stream chat answers of --max-tokens tokens, each sending its next
request as soon as one ends, for --duration seconds: tokens per second in total, time
to first token (p50, p95), and whether every stream ended whole ([DONE] after a
finish_reason; the old server sends no usage in streams, so its tokens are its chunks). Only loopback is used. The targets take turns, so the machine's other load falls
on each.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import requests
from harness import ROOT, Servers, Site, free_port, rotation, table, until

sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")

import django  # noqa: E402

django.setup()

from agent import engines  # noqa: E402
from fleet import bench  # noqa: E402
from launcher import smollm2  # noqa: E402

SLOT_CONTEXT = 512
SYSTEM = "You are a helpful assistant."


def concurrent(url: str, streams: int, duration: float, max_tokens: int, key: str, model: str) -> dict:
    """`streams` clients, each sending its next request as soon as one ends, for `duration` seconds."""
    results: list[dict] = []
    errors: list[str] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + duration

    def client(n: int) -> None:
        i = 0
        while time.monotonic() < stop_at:
            prompt = bench.PROMPTS[(n + i) % len(bench.PROMPTS)]
            try:
                result = bench.stream_once(url, key, model, prompt, max_tokens, system=SYSTEM, temperature=0)
            except (requests.RequestException, bench.BenchError) as error:
                with lock:
                    errors.append(str(error))
                time.sleep(0.1)
                continue
            i += 1
            with lock:
                results.append(result)

    started = time.monotonic()
    threads = [threading.Thread(target=client, args=(n,)) for n in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return bench.summary(results, errors, time.monotonic() - started)


def start_engine(servers: Servers, argv: list[str], name: str, port: int, health: str = "llamacpp") -> None:
    """`health` is the engine whose health path to wait on: the old server has no /health, only /v1/models."""
    log_path = servers.work / f"{name}.log"
    process = servers.adopt(engines.spawn(argv, log_path, engines.engine_env("llamacpp", "")))
    if not engines.wait_until_answers(process, port, timeout=300, engine=health):
        raise SystemExit(f"{name}: the engine did not answer (exit {process.poll()}):\n{engines.last_lines(log_path)}")


def start_gateway(servers: Servers, engine_port: int, slots: int) -> tuple[str, str]:
    """`manage.py gateway` (the data plane alone) on its own SQLite and Redis, routing the model to the engine."""
    _, redis_port = servers.redis()
    site = Site(servers, "gateway", redis_port=redis_port, LLMGW_ADMIN_ADDR=f"127.0.0.1:{free_port()}")
    model_fields = dict(source="http://127.0.0.1:1/m/v1/", context_length=SLOT_CONTEXT)
    endpoint = f"http://127.0.0.1:{engine_port}/v1"
    site.route(
        [
            dict(
                model=smollm2.MODEL,
                endpoints=[endpoint],
                model_fields=model_fields,
                profile_fields=dict(parallel=slots),
            )
        ]
    )
    key = site.create_key("bench")
    site.start()

    def routed() -> bool:
        try:
            listed = requests.get(site.url + "/models", headers={"Authorization": f"Bearer {key}"}, timeout=2)
            return listed.status_code == 200 and any(m.get("ready") for m in listed.json().get("data", []))
        except requests.RequestException:
            return False

    until(routed, 60, "the gateway to route the model", 0.3)
    return site.url, key


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--duration", type=float, default=30)
    parser.add_argument("--streams", default="1,4,16,32")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--old-python", default="", help="an interpreter with llama-cpp-python[server] installed")
    parser.add_argument(
        "--engine-cpus",
        default="",
        help="CPUs (taskset's list, e.g. 0) the engines run on, the clients and the gateway on the others: "
        "as deployed, where the gateway has a host of its own and does not take the engine's cores",
    )
    options = parser.parse_args()
    pin = ["taskset", "-c", options.engine_cpus] if options.engine_cpus else []
    if pin:
        others = set(os.sched_getaffinity(0)) - {int(c) for c in options.engine_cpus.split(",")}
        if not others:
            raise SystemExit(f"--engine-cpus {options.engine_cpus} leaves no CPU for the clients and the gateway")
        os.sched_setaffinity(0, others)  # this process, and the gateway it starts, stay off the engines' CPUs
        print(f"engines on CPU {options.engine_cpus}; clients and gateway on CPU {sorted(others)}", flush=True)

    weights = smollm2.gguf_path()
    args = ["--ctx-size", str(options.slots * SLOT_CONTEXT), "--parallel", str(options.slots)]
    args += ["--threads", str(options.threads)]
    with Servers("llmgw-bench-engine-") as servers:
        targets = start_targets(servers, options, pin, weights, args)
        for _, url, key in targets:
            bench.stream_once(url, key, smollm2.MODEL, "Hello", 4)  # warm up
        rows = []
        for level, streams in enumerate(int(s) for s in options.streams.split(",")):
            for label, url, key in rotation(targets, level):
                r = concurrent(url, streams, options.duration, options.max_tokens, key, smollm2.MODEL)
                errors = f" ({r['errors']} errors)" if r["errors"] else ""
                rows.append(
                    (streams, label, r["requests"], f"{r['whole']}{errors}", f"{r['tokens_per_s']:.1f}")
                    + (f"{r['ttft_p50_ms']:.0f} ms", f"{r['ttft_p95_ms']:.0f} ms")
                )
                print(f"{streams} clients, {label}: {r['tokens_per_s']:.1f} tokens/s", flush=True)
        died = [p for p in servers.processes if p.poll() is not None]
        if died:
            print(f"a process of the run died (exit {died[0].returncode}); the logs are in {servers.work}")
            servers.keep = True
            return 1
    table(["clients", "target", "answers", "whole", "tokens/s", "first token p50", "p95"], rows)
    return 0


def start_targets(
    servers: Servers, options, pin: list[str], weights: Path, args: list[str]
) -> list[tuple[str, str, str]]:
    """The engines and the gateway: (label, base URL, key) of each target."""
    direct_port, gateway_engine_port = free_port(), free_port()
    for name, port in (("direct", direct_port), ("behind-gateway", gateway_engine_port)):
        argv = engines.command("llamacpp", weights, port, args, model=smollm2.MODEL)
        start_engine(servers, pin + argv, name, port)
    print(f"llama-server: {' '.join(argv)}", flush=True)
    built = Path(os.path.realpath(argv[0])).parent / "CMAKE_ARGS"  # argv: the engine's, without taskset
    if built.is_file():
        print(f"built with: {built.read_text().strip()}", flush=True)
    gateway_url, key = start_gateway(servers, gateway_engine_port, options.slots)
    targets = [
        ("through the gateway", gateway_url, key),
        ("llama-server direct", f"http://127.0.0.1:{direct_port}/v1", ""),
    ]
    if options.old_python:
        old_port = free_port()
        old = [options.old_python, "-m", "llama_cpp.server", "--model", str(weights), "--host", "127.0.0.1"]
        old += ["--port", str(old_port), "--n_ctx", "2048", "--n_threads", str(options.threads)]
        old += ["--model_alias", smollm2.MODEL, "--interrupt_requests", "false"]
        start_engine(servers, pin + old, "old", old_port, health="vllm")
        targets.append(("old Python server", f"http://127.0.0.1:{old_port}/v1", ""))
    else:
        print("old Python server: left out (no --old-python with llama-cpp-python[server] installed)")
    return targets


if __name__ == "__main__":
    sys.exit(main())
