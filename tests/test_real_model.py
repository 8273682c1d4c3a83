"""A real model, end to end: SmolLM2-135M-Instruct (Q4_1) on this host's llama.cpp, greedy.

Every other engine test runs a generated F32 model whose answers are random; the
quantized kernels a real model takes are where a build for the wrong CPU dies
(SIGILL on the first token). So here the real model is started the way the agent
starts it and must say Paris where every kernel mix says it (tests/real_model.py):
through the supervisor (a plain completion), through the gateway (whole, streamed, with
usage, and the engine's own 400 for a prompt too long), with the README's own question
and its sampling spelled out, from the mirror through an agent, and with 16 clients
streaming at once for a minute, every answer whole.
"""

from __future__ import annotations

import shutil

import pytest
import requests

from agent import engine_state, engines, supervisor
from catalog.models import Model, Profile
from fleet.models import Node, Replica
from gateway.keys import create_key
from gateway.models import Usage
from mirror import scan

from . import real_model
from .real_model import ANSWER, MODEL, ask, assert_chat_answer, complete, streamed_whole
from .staff_api import token_session
from .support.mirror import settle
from .support.processes import wait_until

pytestmark = pytest.mark.engine


class Reports(list):
    def __call__(self, replica_id, state, endpoint, reason):
        self.append((replica_id, state, endpoint, reason))


# --- through the agent's own engine start ----------------------------------------------


def test_the_real_quantized_model_answers_through_the_agents_own_engine_start(tmp_path, real_model_weights):
    """The test that catches a build for the wrong CPU: it crashes here, on the first token."""
    cache = tmp_path / "cache"
    reports = Reports()
    sup = supervisor.Supervisor(cache, reports)
    engine_state.want(cache, 1, "llamacpp", "http://mirror/smollm2-135m/instruct-q4_1/", real_model_weights, [], MODEL)
    try:
        wait_until(
            lambda: sup.step() or any(r[1] in ("ready", "failed") for r in reports),
            timeout=180,
            what="the engine to be ready",
        )
        assert [r[1] for r in reports] == ["starting", "ready"], reports
        endpoint = reports[-1][2]
        # A plain completion: the model's own continuation of a fact, the same on every kernel mix.
        answer = requests.post(endpoint + "/completions", json=complete(), timeout=120)
        sup.step()
        # A crash on the first token (SIGILL) ends the engine; the supervisor says so with its code.
        crashed = [r[3] for r in reports if r[1] == "failed"]
        assert not crashed, f"the engine crashed answering: {crashed[0]}"
        assert answer.status_code == 200, answer.text
        text = answer.json()["choices"][0]["text"]
        assert text.startswith(" " + ANSWER), text
        assert answer.json()["usage"]["completion_tokens"] > 0
    finally:
        for entry in engine_state.read_state(cache)["replicas"].values():
            if entry.get("pid"):
                engines.stop_group(entry["pid"], grace=3)


# --- through the gateway -------------------------------------------------------------------


@pytest.fixture
def model_behind_gateway(transactional_db, engine, gateway):
    """The real engine as the one ready replica of `smollm2-135m`, and a client with a key."""
    Model.objects.create(name=MODEL, source="http://127.0.0.1:1/smollm2-135m/instruct-q4_1/", context_length=2048)
    Profile.objects.create(model=Model.objects.get(name=MODEL), name="cpu", engine="llamacpp")
    node = Node.objects.create(name="n1")
    Replica.objects.create(model_name=MODEL, profile_name="cpu", node=node, state="ready", endpoint=engine)
    _, secret = create_key("real")
    client = requests.Session()
    client.headers["Authorization"] = f"Bearer {secret}"
    wait_until(
        # A key made a moment ago may be refused until the gateway's next look at its keys.
        lambda: any(m["ready"] for m in client.get(gateway.url + "/v1/models").json().get("data", [])),
        timeout=10,
        what="the gateway to route the model",
    )
    return client, gateway.url


def test_through_the_gateway_the_real_model_says_paris_whole_and_streamed_and_both_are_counted(model_behind_gateway):
    client, url = model_behind_gateway
    whole = client.post(url + "/v1/chat/completions", json={"model": MODEL, **ask()}, timeout=120)
    assert whole.status_code == 200, whole.text
    answer = whole.json()
    assert_chat_answer(answer)

    with client.post(
        url + "/v1/chat/completions",
        json={"model": MODEL, **ask(), "stream": True, "stream_options": {"include_usage": True}},
        stream=True,
        timeout=120,
    ) as streamed:
        assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
        text, usage, finish = streamed_whole(real_model.stream_events(streamed))
    # Greedy: the same words as the whole answer, and the same count.
    assert text == answer["choices"][0]["message"]["content"]
    assert finish == answer["choices"][0]["finish_reason"]

    # The same count; how much of the prompt came from the slot's cache differs (the second reuses the first's).
    def counts(u: dict) -> dict:
        return {k: v for k, v in u.items() if k != "prompt_tokens_details"}

    assert counts(usage) == counts(answer["usage"])

    def counted():
        row = Usage.objects.filter(key__name="real", model_name=MODEL).first()
        return row if row is not None and row.requests == 2 else None

    row = wait_until(counted, timeout=10, what="the usage to be written")
    assert row.completion_tokens == 2 * answer["usage"]["completion_tokens"]


def test_the_readmes_own_question_with_its_sampling_spelled_out_says_paris(model_behind_gateway):
    """The README's curl (its system message and question), greedy as both engines take it spelled out."""
    client, url = model_behind_gateway
    body = {"model": MODEL, **ask(real_model.README_QUESTION), **real_model.README_SAMPLING}
    answer = client.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    assert assert_chat_answer(answer.json()) == "The capital of France is Paris."


def test_a_plain_completion_through_the_gateway_continues_the_fact(model_behind_gateway):
    client, url = model_behind_gateway
    answer = client.post(url + "/v1/completions", json={"model": MODEL, **complete()}, timeout=120)
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    assert choice["text"].startswith(" " + ANSWER) and choice["finish_reason"] == "length", choice
    assert answer.json()["usage"]["completion_tokens"] == 4


def test_a_prompt_longer_than_the_engines_context_is_the_engines_own_400(model_behind_gateway):
    client, url = model_behind_gateway
    # About 3,000 tokens for a context of 2,048: the gateway cannot count them, the engine can.
    too_long = client.post(
        url + "/v1/chat/completions", json={"model": MODEL, **ask("Paris is lovely. " * 750)}, timeout=120
    )
    assert too_long.status_code == 400, too_long.text
    message = too_long.json()["error"]["message"]
    assert "exceeds the available context size" in message and "2048" in message, message


STREAMS = 16
SECONDS = 60
PROMPTS = [real_model.QUESTION, "Name three colours.", "Count from 1 to 10.", "Say hello."]


def test_sixteen_clients_streaming_at_once_for_a_minute_each_get_their_whole_answer(model_behind_gateway):
    """PyPI's server cut a running stream whenever another request arrived; started as the agent
    starts it, every stream must end in [DONE] with its finish_reason and usage."""
    client, url = model_behind_gateway
    done, broken = real_model.streaming_clients(url, client.headers["Authorization"], PROMPTS, STREAMS, SECONDS, 24)
    assert not broken, f"{len(broken)} of {len(broken) + len(done)} streams broken, the first: {broken[0]}"
    # Every client got at least one whole answer: queued behind the others, not dropped.
    assert len(done) >= STREAMS, done


# --- from the mirror, through an agent -------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_the_real_model_copied_into_the_mirror_is_served_fetched_started_and_says_paris_through_the_gateway(
    settings, real_model_weights, mirror_root, byte_listener, control_worker, agent_n1, live_server, gateway
):
    agent, cache = agent_n1
    settings.BYTES_URL = byte_listener
    version = mirror_root / MODEL / "instruct-q4_1"
    version.mkdir(parents=True)
    shutil.copyfile(real_model_weights, version / real_model_weights.name)
    settle(version)  # copied in a while ago: whole, not still being written (LLMGW_MIRROR_SETTLE_S)
    scan.scan_mirror()

    def enrolled():
        node = Node.objects.filter(name="n1").first()
        return node is not None and node.state == Node.State.READY and "llamacpp" in node.engines

    wait_until(enrolled, timeout=120, interval=0.5, what=f"n1's heartbeat with llamacpp\n{agent.output()[-3000:]}")
    assert Node.objects.get(name="n1").engines_unusable == {}

    api = token_session()
    plan = api.get(live_server.url + f"/api/serve/plan/?model={MODEL}&version=instruct-q4_1").json()
    assert (
        plan["engine"] == "llamacpp"
        and plan["source"] == f"{byte_listener}{MODEL}/instruct-q4_1/{real_model_weights.name}"
    ), plan
    served = api.post(
        live_server.url + "/api/serve/",
        json={
            "name": MODEL,
            "source": plan["source"],
            "engine": plan["engine"],
            "profile": plan["profile"],
            "context_length": 2048,
            "ctx_size": 2048,
            "replicas": 1,
            "min_memory_gb": plan["min_memory_gb"],
        },
    )
    assert served.status_code == 201, served.text
    wait_until(
        lambda: Replica.objects.filter(model_name=MODEL, state="ready").exists(),
        timeout=300,
        interval=0.5,
        what=f"a ready replica: {list(Replica.objects.values('state', 'reason'))}\n{agent.output()[-3000:]}",
    )

    _, secret = create_key("e2e")
    client = requests.Session()
    client.headers["Authorization"] = f"Bearer {secret}"
    wait_until(
        lambda: [m["ready"] for m in client.get(gateway.url + "/v1/models").json().get("data", [])] == [True],
        timeout=10,
        what="the gateway to route the model",
    )
    answer = client.post(gateway.url + "/v1/chat/completions", json={"model": MODEL, **ask()}, timeout=120)
    assert answer.status_code == 200, answer.text
    assert_chat_answer(answer.json())
