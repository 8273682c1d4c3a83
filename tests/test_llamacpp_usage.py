"""Streamed answers from PyPI's llama.cpp server carry the usage the gateway counts.

A real engine, started the way the supervisor starts it (`engines.command` and
`engines.spawn`, so through `agent.llamacpp_server`), on the tiny GGUF the tests
write. Each request is sent twice, unstreamed and streamed, greedy and with
end-of-text barred, so both generate the same tokens and must report the same usage.
"""

from __future__ import annotations

import json
import logging
import os

import pytest
import requests

from agent import engines, llamacpp_server
from launcher.demo_model import EOS_TOKEN_ID, write_tiny_llama

SAME_TOKENS = {
    "max_tokens": 8,
    "temperature": 0,
    "seed": 7,
    # Random weights may well pick end-of-text first; the tests want tokens.
    "logit_bias": {str(EOS_TOKEN_ID): -100},
}


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    weights = tmp_path_factory.mktemp("weights")
    write_tiny_llama(weights)
    port = engines.free_port()
    argv = engines.command("llamacpp", weights, port, ["--n_ctx", "256"], which=lambda name: None)
    elsewhere = tmp_path_factory.mktemp("engine")
    log_path = elsewhere / "engine.log"
    # Spawned from a directory without the agent package in it, as by an agent
    # started from anywhere: `python -m agent.llamacpp_server` must still import.
    started_in = os.getcwd()
    os.chdir(elsewhere)
    try:
        process = engines.spawn(argv, log_path)
    finally:
        os.chdir(started_in)
    try:
        if not engines.wait_until_answers(process, port, timeout=120):
            pytest.fail("the engine did not answer:\n" + engines.last_lines(log_path))
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        engines.stop_group(process.pid, grace=5)
        process.wait(timeout=10)


def unstreamed(url: str, body: dict) -> dict:
    r = requests.post(url, json={**body, **SAME_TOKENS}, timeout=60)
    r.raise_for_status()
    return r.json()


def streamed(url: str, body: dict) -> list[dict]:
    """The chunks of a streamed answer, asked for as the gateway asks: with include_usage."""
    request = {**body, **SAME_TOKENS, "stream": True, "stream_options": {"include_usage": True}}
    with requests.post(url, json=request, stream=True, timeout=60) as r:
        r.raise_for_status()
        events = [
            line.removeprefix("data: ") for line in r.iter_lines(decode_unicode=True) if line.startswith("data: ")
        ]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


def finished(chunks: list[dict]) -> dict:
    """The one chunk with a finish_reason; no other chunk carries usage."""
    final = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"] is not None]
    assert len(final) == 1 and final[0] is chunks[-1]
    assert all("usage" not in c or c["usage"] is None for c in chunks[:-1])
    return final[0]


@pytest.mark.engine
def test_a_streamed_completion_ends_with_the_usage_the_unstreamed_one_reports(endpoint):
    body = {"prompt": "Once upon a time"}
    whole = unstreamed(endpoint + "/completions", body)
    chunks = streamed(endpoint + "/completions", body)

    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    final = finished(chunks)
    assert final["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"] == "length"
    assert whole["usage"]["completion_tokens"] > 0
    assert final["usage"] == whole["usage"]
    assert final["usage"]["total_tokens"] == final["usage"]["prompt_tokens"] + final["usage"]["completion_tokens"]


@pytest.mark.engine
def test_a_streamed_chat_completion_ends_with_the_usage_the_unstreamed_one_reports(endpoint):
    body = {"messages": [{"role": "user", "content": "hello"}]}
    whole = unstreamed(endpoint + "/chat/completions", body)
    chunks = streamed(endpoint + "/chat/completions", body)

    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert content == whole["choices"][0]["message"]["content"]
    final = finished(chunks)
    assert final["object"] == "chat.completion.chunk"
    assert final["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"] == "length"
    assert whole["usage"]["completion_tokens"] > 0
    assert final["usage"] == whole["usage"]


@pytest.mark.engine
def test_a_stream_that_stops_at_a_stop_string_reports_the_unstreamed_usage(endpoint):
    """The stop-string path holds tokens back before yielding; the counts must still agree."""
    body = {"prompt": "Once upon a time"}
    text = unstreamed(endpoint + "/completions", body)["choices"][0]["text"]
    printable = [ch for ch in text[1:] if ch.isprintable() and not ch.isspace()]
    if not printable:
        pytest.skip(f"the tiny model's text {text!r} has no character to stop at")
    body["stop"] = [printable[0]]
    whole = unstreamed(endpoint + "/completions", body)
    final = finished(streamed(endpoint + "/completions", body))
    assert final["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"] == "stop"
    assert final["usage"] == whole["usage"]


# --- when llama-cpp-python is not what the shim expects ------------------------------


@pytest.fixture
def warned(monkeypatch, caplog):
    monkeypatch.setattr(llamacpp_server, "_warned", False)
    caplog.set_level(logging.WARNING, logger="llmgw.llamacpp_server")
    return caplog


def test_a_llama_cpp_python_with_other_internals_is_left_as_it_is_with_one_warning(monkeypatch, warned):
    from llama_cpp import llama, llama_chat_format

    create = llama.Llama._create_completion
    monkeypatch.setattr(llama_chat_format, "_convert_text_completion_chunks_to_chat", lambda chunks: iter(chunks))
    assert llamacpp_server.install() is False
    assert llama.Llama._create_completion is create
    assert [r.getMessage() for r in warned.records] == [
        "llama-cpp-python's internals are not the ones this shim knows; streamed answers go without usage"
    ]


def test_a_generator_without_the_counts_streams_on_without_usage_and_warns_once(warned):
    def chunks():
        yield {"choices": [{"text": "a", "finish_reason": None}]}
        yield {"choices": [{"text": "", "finish_reason": "stop"}]}

    for _ in range(2):
        assert list(llamacpp_server._completion_chunks_with_usage(chunks())) == list(chunks())
    assert len(warned.records) == 1
    assert "no longer keeps prompt_tokens and completion_tokens" in warned.records[0].getMessage()
