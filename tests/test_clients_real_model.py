"""The official Anthropic and OpenAI clients against the real model: SmolLM2 on PyPI's llama.cpp server.

That server speaks only chat completions, so every request here is translated by
the gateway both ways; the model must still say Paris (to the question every kernel mix
answers the same, tests/real_model.py), whole and streamed, and every answer must be counted.
"""

from __future__ import annotations

import pytest

from catalog.models import Model, Profile
from fleet.models import Node, Replica
from gateway.keys import create_key
from gateway.models import Usage

from .real_model import ANSWER, GREEDY, MODEL, QUESTION, SYSTEM
from .support.gateway import client, until_routed
from .support.processes import wait_until
from .support.sdk import anthropic, openai

pytestmark = [pytest.mark.engine, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def clients(engine, gateway):
    model = Model.objects.create(name=MODEL, source="http://127.0.0.1:1/smollm2/", context_length=2048)
    Profile.objects.create(model=model, name="cpu", engine="llamacpp")
    node = Node.objects.create(name="n1")
    Replica.objects.create(model_name=MODEL, profile_name="cpu", node=node, state="ready", endpoint=engine)
    _, secret = create_key("real")
    until_routed(client(secret), gateway.url, MODEL)
    claude = anthropic.Anthropic(base_url=gateway.url, api_key=secret, max_retries=0, timeout=120)
    gpt = openai.OpenAI(base_url=gateway.url + "/v1", api_key=secret, max_retries=0, timeout=120)
    return claude, gpt


def test_the_real_model_says_paris_through_messages_and_responses_whole_and_streamed_all_counted(clients):
    claude, gpt = clients
    question = [{"role": "user", "content": QUESTION}]

    message = claude.messages.create(model=MODEL, system=SYSTEM, messages=question, max_tokens=48, extra_body=GREEDY)
    assert ANSWER in message.content[0].text, message
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0

    with claude.messages.stream(
        model=MODEL, system=SYSTEM, messages=question, max_tokens=48, extra_body=GREEDY
    ) as stream:
        text = "".join(stream.text_stream)
        streamed = stream.get_final_message()
    # Greedy: the same words and the same count as the whole answer. The prompt is the same too; the engine
    # had it cached the second time, which no client is shown (another key's prompt could be probed by it).
    assert text == message.content[0].text
    assert streamed.usage.cache_read_input_tokens == message.usage.cache_read_input_tokens == 0, streamed.usage
    assert (streamed.usage.input_tokens, streamed.usage.output_tokens) == (
        message.usage.input_tokens,
        message.usage.output_tokens,
    )
    assert streamed.stop_reason == message.stop_reason

    response = gpt.responses.create(
        model=MODEL, instructions=SYSTEM, input=QUESTION, max_output_tokens=48, extra_body=GREEDY
    )
    assert ANSWER in response.output_text, response
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens > 0

    events = list(
        gpt.responses.create(
            model=MODEL, instructions=SYSTEM, input=QUESTION, max_output_tokens=48, extra_body=GREEDY, stream=True
        )
    )
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == response.output_text
    finished = events[-1].response
    assert finished.usage.output_tokens == response.usage.output_tokens

    def counted():
        row = Usage.objects.filter(key__name="real", model_name=MODEL).first()
        return row if row is not None and row.requests == 4 else None

    row = wait_until(counted, timeout=10, what="four answers counted")
    assert row.completion_tokens == 2 * message.usage.output_tokens + 2 * response.usage.output_tokens
