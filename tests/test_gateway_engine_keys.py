"""What each address passes to the engine: its API's keys, and an engine's own only when the operator allows them.

Every request goes through a real gateway process (`manage.py gateway`) to a fake replica
(tests/fake_replica.py, a real HTTP server that records the bodies it is sent), because
what is asserted is what an engine would receive, whatever it makes of it.
"""

from __future__ import annotations

import inspect

import pytest
import requests

from catalog.models import Model
from gateway.intake import PASSED
from gateway.keys import create_key

from .support.factories import add_model, add_replica
from .support.gateway import client, until_routed
from .support.gateway_process import start_gateway
from .support.sdk import openai

pytestmark = pytest.mark.django_db(transaction=True)

HI = [{"role": "user", "content": "hi"}]
BODIES = {
    "/v1/chat/completions": {"model": "chat", "messages": HI},
    "/v1/completions": {"model": "chat", "prompt": "hi"},
    "/v1/embeddings": {"model": "embedder", "input": "hi"},
    "/v1/rerank": {"model": "reranker", "query": "hi", "documents": ["a", "b"]},
    "/v1/messages": {"model": "chat", "max_tokens": 8, "messages": HI},
    "/v1/responses": {"model": "chat", "input": "hi"},
}
# llama-server's own keys, each reaching around something the gateway bounds (docs/gateway.md).
ENGINE_KEYS = {
    "n_predict": 100000,
    "id_slot": 0,
    "slot_id": 0,
    "cache_prompt": True,
    "n_cache_reuse": 256,
    "grammar": "root ::= [a]*",
    "json_schema": {"type": "object"},
    "n_keep": -1,
    "n_discard": 0,
    "t_max_predict_ms": 1,
    "n_cmpl": 8,
    "lora": [{"id": 0, "scale": 1.0}],
    "samplers": ["top_k"],
    "chat_template_kwargs": {"enable_thinking": True},
    "n_probs": 100000,
}
# What one address alone would be made to do by a key of its own.
ALSO_REFUSED = {
    "/v1/completions": {"best_of": 16},
    "/v1/embeddings": {"content": "x" * 10},  # llama-server's other input, which the length guard does not read
    "/v1/rerank": {"texts": ["x" * 10]},  # TEI's name for the documents, the same
}
# Keys the official clients' create() take that the gateway does not pass on, and why (intake.py).
NOT_PASSED = {"/v1/completions": {"best_of"}}


def clients() -> dict:
    """Each address's create() in the official clients (imported here: tests/support/sdk.py says why)."""
    from anthropic.resources.messages import Messages
    from openai.resources.chat.completions import Completions as ChatCompletions
    from openai.resources.completions import Completions
    from openai.resources.embeddings import Embeddings
    from openai.resources.responses import Responses

    return {
        "/v1/chat/completions": ChatCompletions.create,
        "/v1/completions": Completions.create,
        "/v1/embeddings": Embeddings.create,
        "/v1/responses": Responses.create,
        "/v1/messages": Messages.create,
    }


CLIENT_ONLY = {"self", "extra_headers", "extra_query", "extra_body", "timeout"}


@pytest.fixture
def replica_and_gateways(tmp_path, replicas):
    """One replica of a chat, an embedding and a rerank model: (replica, make); make(**env) starts a gateway to it."""
    replica = replicas()
    add_model("chat")
    for name, kind in (("embedder", "embedding"), ("reranker", "rerank")):
        Model.objects.filter(pk=add_model(name).pk).update(kind=kind)
    for name in ("chat", "embedder", "reranker"):
        add_replica(name, replica.base)
    _, secret = create_key("k")
    session = client(secret)
    started = []

    def make(**env):
        directory = tmp_path / f"g{len(started)}"
        directory.mkdir()
        process, url = start_gateway(directory, **env)
        started.append(process)
        for name in ("chat", "embedder", "reranker"):
            until_routed(session, url, name)
        return session, url, secret

    yield replica, make
    for process in started:
        process.stop()


def message_of(response: requests.Response) -> dict:
    """(message, param, code) of an error in the address's own shape: Anthropic's has no param or code."""
    body = response.json()
    if body.get("type") == "error":
        return {"message": body["error"]["message"], "param": None, "code": None}
    return {key: body["error"][key] for key in ("message", "param", "code")}


def test_each_engine_key_is_refused_on_every_address_with_a_sentence_that_names_it_and_the_setting(
    replica_and_gateways,
):
    replica, make = replica_and_gateways
    session, url, _ = make()
    for path, body in BODIES.items():
        for key, value in {**ENGINE_KEYS, **ALSO_REFUSED.get(path, {})}.items():
            refused = session.post(url + path, json={**body, key: value}, timeout=30)
            assert refused.status_code == 400, (path, key, refused.text)
            error = message_of(refused)
            assert error["message"].startswith(f'"{key}" is not passed to the engine'), (path, error)
            assert error["message"].endswith("the operator can allow it with LLMGW_GATEWAY_ENGINE_KEYS."), error
            if path != "/v1/messages":
                assert (error["param"], error["code"]) == (key, "engine_key_refused")
    refused = session.post(url + "/v1/chat/completions", json={**BODIES["/v1/chat/completions"], "n_predict": 9})
    assert 'reaches around the output limit: send "max_tokens"' in message_of(refused)["message"]
    assert replica.requests == []


def test_every_key_the_official_clients_send_is_passed_on():
    for path, create in clients().items():
        sent = set(inspect.signature(create).parameters) - CLIENT_ONLY
        assert sent - NOT_PASSED.get(path, set()) <= PASSED[path], (path, sent - PASSED[path])


def test_openais_keys_and_the_samplers_reach_the_engine_as_sent_on_each_address(replica_and_gateways):
    replica, make = replica_and_gateways
    session, url, secret = make()
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    sent = {
        "/v1/chat/completions": {
            "user": "u1",
            "seed": 7,
            "stop": ["\n"],
            "n": 2,
            "temperature": 0.5,
            "top_p": 0.9,
            "presence_penalty": 0.1,
            "frequency_penalty": 0.1,
            "logit_bias": {"42": -100},
            "logprobs": True,
            "top_logprobs": 3,
            "tools": [tool],
            "tool_choice": "auto",
            "parallel_tool_calls": False,
            "response_format": {"type": "json_object"},
            "stream_options": {"include_usage": True},
            "metadata": {"a": "b"},
            "reasoning_effort": "low",
            "top_k": 1,
            "min_p": 0.05,
            "repeat_penalty": 1.0,
            "ignore_eos": True,
        },
        "/v1/completions": {"suffix": "!", "echo": False, "logprobs": 2, "seed": 7, "stop": "\n", "user": "u1"},
        "/v1/embeddings": {"dimensions": 8, "encoding_format": "float", "user": "u1"},
        "/v1/rerank": {"top_n": 1, "return_documents": True},
    }
    for path, keys in sent.items():
        answered = session.post(url + path, json={**BODIES[path], **keys}, timeout=30)
        assert answered.status_code == 200, (path, answered.text)
        received = replica.requests[-1]
        assert {key: received.get(key) for key in keys} == keys, path

    # A translated request carries the samplers past its translation to the engine.
    for path in ("/v1/messages", "/v1/responses"):
        answered = session.post(url + path, json={**BODIES[path], "seed": 7, "min_p": 0.05, "metadata": {}})
        assert answered.status_code == 200, (path, answered.text)
        assert (replica.requests[-1]["seed"], replica.requests[-1]["min_p"]) == (7, 0.05)

    # The official clients, with the keys they take.
    gpt = openai.OpenAI(base_url=url + "/v1", api_key=secret, max_retries=0)
    gpt.chat.completions.create(
        model="chat", messages=HI, user="u2", seed=3, stop=["."], presence_penalty=0.2, logprobs=True, top_logprobs=2
    )
    assert replica.requests[-1]["user"] == "u2" and replica.requests[-1]["top_logprobs"] == 2
    gpt.completions.create(model="chat", prompt="hi", suffix="!", logprobs=1, user="u2")
    assert replica.requests[-1]["suffix"] == "!"

    # OpenAI's bounds on the alternatives listed per token: each is a row of the vocabulary.
    for path, key, value in (("/v1/chat/completions", "top_logprobs", 100000), ("/v1/completions", "logprobs", 50)):
        refused = session.post(url + path, json={**BODIES[path], key: value}, timeout=30)
        assert refused.status_code == 400 and message_of(refused)["param"] == key, refused.text


def test_the_operator_lets_a_named_engine_key_through_on_every_address_and_no_other(replica_and_gateways):
    replica, make = replica_and_gateways
    session, url, _ = make(LLMGW_GATEWAY_ENGINE_KEYS="cache_prompt, n_cache_reuse")
    for path, body in BODIES.items():
        answered = session.post(url + path, json={**body, "cache_prompt": False, "n_cache_reuse": 0}, timeout=30)
        assert answered.status_code == 200, (path, answered.text)
        assert (replica.requests[-1]["cache_prompt"], replica.requests[-1]["n_cache_reuse"]) == (False, 0), path
        still = session.post(url + path, json={**body, "n_predict": 5}, timeout=30)
        assert still.status_code == 400 and message_of(still)["message"].startswith('"n_predict" is not passed')
