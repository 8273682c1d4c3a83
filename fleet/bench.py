"""What a replica can do: load through the gateway at a few concurrencies, recorded on its profile.

`manage.py bench_replica MODEL` (the seed's `llmgw ctl bench`) calls `run`: for each level
(1, 4 and 16 requests at once by default) it streams chat answers through the gateway,
counts tokens per second and time to first token, and reads the memory the replica's
node last measured. The result goes on the model's profile (`MeasuredMemory.bench`),
shown in the admin, with the target load it suggests: the concurrency past which the
replica's throughput stops growing.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Callable, Sequence

import requests
from django.conf import settings
from django.utils import timezone

from . import memory
from .models import MeasuredMemory, Replica

PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a CPU does.",
    "Name five animals and say one thing about each.",
]
# A level counts as worth its concurrency when it gives this much more throughput than the one before.
GAIN = 1.2


class BenchError(Exception):
    """The bench cannot run as asked; the message is the sentence to show."""


def stream_once(
    url: str,
    key: str,
    model: str,
    prompt: str,
    max_tokens: int,
    system: str = "",
    temperature: float | None = None,
    extra: dict | None = None,
) -> dict:
    """One streamed chat answer: time to first token, tokens, and whether it ended whole
    ([DONE] after a finish_reason). `key` "" sends no Authorization (an engine asked directly);
    `extra` adds fields to the body (a test's logit_bias)."""
    body = _chat_body(model, prompt, max_tokens, system, temperature, extra)
    started = time.perf_counter()
    first = finish = None
    tokens = chunks = 0
    ended = False
    with requests.post(
        url.rstrip("/") + "/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"} if key else {},
        stream=True,
        timeout=600,
    ) as response:
        if response.status_code != 200:
            raise BenchError(f"the gateway answered {response.status_code}: {response.text[:300]}")
        for line in response.iter_lines(decode_unicode=True):
            if not line or not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                ended = True
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                tokens = int(chunk["usage"].get("completion_tokens") or 0)
            for choice in chunk.get("choices") or []:
                shown = bool((choice.get("delta") or {}).get("content"))
                chunks += shown
                finish = choice.get("finish_reason") or finish
                # An answer whose tokens show no text (bytes that make no whole character yet, or
                # an end at once) has its first token when its end arrives: it was computed by then.
                if first is None and (shown or finish is not None):
                    first = time.perf_counter() - started
    # A server that sends no usage in streams (llama-cpp-python's ignores stream_options): a token a chunk.
    return {
        "ttft": first,
        "tokens": tokens or chunks,
        "seconds": time.perf_counter() - started,
        "whole": ended and finish is not None,
    }


def _chat_body(
    model: str, prompt: str, max_tokens: int, system: str, temperature: float | None, extra: dict | None
) -> dict:
    """A streamed chat request's body, asking for usage at its end."""
    messages = [{"role": "system", "content": system}] if system else []
    body = {
        "model": model,
        "messages": messages + [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if temperature is not None:
        body["temperature"] = temperature
    body.update(extra or {})
    return body


def summary(results: list[dict], errors: list[str], elapsed: float) -> dict:
    """Tokens per second in total and time to first token (p50, p95) of a level's answers."""
    ttfts = sorted(r["ttft"] for r in results if r["ttft"] is not None)
    return {
        "requests": len(results),
        "whole": sum(bool(r.get("whole")) for r in results),
        "errors": len(errors),
        "first_error": errors[0] if errors else "",
        "tokens_per_s": sum(r["tokens"] for r in results) / elapsed if elapsed else 0.0,
        "ttft_p50_ms": statistics.median(ttfts) * 1000 if ttfts else 0.0,
        "ttft_p95_ms": ttfts[int(0.95 * (len(ttfts) - 1))] * 1000 if ttfts else 0.0,
        "seconds": elapsed,
    }


def level(url: str, key: str, model: str, concurrency: int, rounds: int, max_tokens: int) -> dict:
    """`concurrency` clients, each sending `rounds` requests one after another."""
    results: list[dict] = []
    errors: list[str] = []
    lock = threading.Lock()

    def client(n: int) -> None:
        for i in range(rounds):
            try:
                result = stream_once(url, key, model, PROMPTS[(n + i) % len(PROMPTS)], max_tokens)
            except (requests.RequestException, BenchError, ValueError) as error:
                with lock:
                    errors.append(str(error))
                continue
            with lock:
                results.append(result)

    started = time.monotonic()
    threads = [threading.Thread(target=client, args=(n,)) for n in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"concurrency": concurrency, **summary(results, errors, time.monotonic() - started)}


def suggested_target_load(levels: Sequence[dict]) -> int:
    """The concurrency past which throughput stops growing: each level kept while it gives GAIN× the one before."""
    best = levels[0]["concurrency"] if levels else 1
    previous = None
    for result in levels:
        if result["errors"] and not result["requests"]:
            break
        if previous is not None and result["tokens_per_s"] < previous["tokens_per_s"] * GAIN:
            break
        best, previous = result["concurrency"], result
    return max(int(best), 1)


def memory_now(replica: Replica) -> int:
    """The replica's host memory by its node's latest heartbeat; on a busy node that one may be
    late, so its next is waited for (a heartbeat's time at most), and 0 only if none comes."""
    deadline = time.monotonic() + settings.HEARTBEAT_S * settings.HEARTBEATS_MISSED
    while True:
        measured, _ = memory.latest([replica.node.name])
        now = measured.get(replica.pk)
        if now is not None and now.node == replica.node.name:
            return now.host
        if time.monotonic() >= deadline:
            return 0
        time.sleep(0.2)


def ready_replica(model: str) -> Replica:
    replica = Replica.objects.select_related("node").filter(model_name=model, state=Replica.State.READY).first()
    if replica is None:
        raise BenchError(f"{model} has no ready replica to bench; wake it or wait for one")
    return replica


def run(
    model: str,
    url: str,
    key: str,
    levels: Sequence[int] = (1, 4, 16),
    rounds: int = 2,
    max_tokens: int = 32,
    say: Callable[[str], None] = lambda line: None,
) -> MeasuredMemory:
    """Bench MODEL's ready replica through the gateway at each level; the profile's record, saved."""
    replica = ready_replica(model)
    results = []
    for concurrency in levels:
        result = level(url, key, model, concurrency, rounds, max_tokens)
        if not result["requests"]:
            raise BenchError(f"no request at {concurrency} at once was answered: {result['first_error']}")
        result["memory_bytes"] = memory_now(replica)
        results.append(result)
        say(
            f"{concurrency:>3} at once: {result['tokens_per_s']:.1f} tokens/s, TTFT p50 {result['ttft_p50_ms']:.0f} ms "
            f"p95 {result['ttft_p95_ms']:.0f} ms, {result['requests']} answers, {result['errors']} errors, "
            f"memory {result['memory_bytes'] / (1 << 20):.0f} MB"
        )
    record, _ = MeasuredMemory.objects.get_or_create(model_name=model, profile_name=replica.profile_name)
    record.bench = {
        "levels": results,
        "replica": replica.pk,
        "node": replica.node.name,
        "suggested_target_load": suggested_target_load(results),
    }
    record.bench_at = timezone.now()
    record.save(update_fields=["bench", "bench_at"])
    return record
