"""Anthropic Messages and OpenAI Responses as their official clients see them, through the real gateway.

The replica here is the steerable one (fake_replica.py), a real HTTP server that
speaks chat completions, because an engine cannot be made to call a tool, stop on
a named sequence or answer 429 on cue; tests/test_clients_real_model.py asks the
real model the same way.
"""

from __future__ import annotations

import json

import pytest
import requests

from gateway.keys import create_key
from gateway.models import Usage

from .support.factories import add_model, add_replica
from .support.gateway import client, until_routed
from .support.sdk import anthropic, openai
from .support.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

WEATHER = {
    "name": "weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
WEATHER_FUNCTION = {
    "type": "function",
    "name": "weather",
    "description": "The weather in a city.",
    "parameters": WEATHER["input_schema"],
}


@pytest.fixture
def sdk_clients(gateway, replicas):  # noqa: F811
    """The model `chat` on one steerable replica; (replica, Anthropic client, OpenAI client)."""
    add_model("chat", aliases=["assistant"])
    replica = replicas()
    add_replica("chat", replica.base)
    _, secret = create_key("clients")
    until_routed(client(secret), gateway.url)
    claude = anthropic.Anthropic(base_url=gateway.url, api_key=secret, max_retries=0)
    gpt = openai.OpenAI(base_url=gateway.url + "/v1", api_key=secret, max_retries=0)
    return replica, claude, gpt


# --- Anthropic Messages --------------------------------------------------------------


def test_a_message_goes_to_the_engine_as_a_chat_and_comes_back_in_anthropics_shape(sdk_clients):
    replica, claude, _ = sdk_clients
    message = claude.messages.create(
        model="assistant",
        system=[{"type": "text", "text": "Be brief."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        max_tokens=20,
        stop_sequences=["END"],
        # Anthropic's API and client 2.x dropped these two; clients that still send them are served.
        extra_body={"temperature": 0.5, "top_p": 0.9},
    )
    assert message.type == "message" and message.role == "assistant" and message.model == "assistant"
    assert [(b.type, b.text) for b in message.content] == [("text", "ok")]
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert (message.usage.input_tokens, message.usage.output_tokens) == (11, 3)
    sent = replica.requests[-1]
    assert sent["model"] == "chat"
    assert sent["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert (sent["max_tokens"], sent["temperature"], sent["top_p"], sent["stop"]) == (20, 0.5, 0.9, ["END"])


def test_an_answer_ended_by_a_stop_sequence_says_which_when_the_engine_does(sdk_clients):
    replica, claude, _ = sdk_clients
    replica.stop_reason = "END"
    message = claude.messages.create(
        model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=20, stop_sequences=["END"]
    )
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "END")


def test_a_streamed_message_comes_as_anthropics_events_in_order_with_usage(sdk_clients):
    _, claude, _ = sdk_clients
    stream = claude.messages.create(
        model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=20, stream=True
    )
    events = list(stream)
    kinds = [e.type for e in events]
    # The ping the gateway sends after message_start is one the client keeps to itself.
    assert kinds == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == "c0c1c2"
    delta = events[-2]
    assert delta.delta.stop_reason == "end_turn" and delta.usage.output_tokens == 3

    with claude.messages.stream(model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=20) as s:
        final = s.get_final_message()
    assert final.content[0].text == "c0c1c2"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (11, 3)


def test_a_tool_call_is_a_tool_use_block_whole_and_streamed_and_its_result_goes_back(sdk_clients):
    replica, claude, _ = sdk_clients
    replica.tool_call = {"name": "weather", "arguments": json.dumps({"city": "Paris"})}
    question = [{"role": "user", "content": "Weather in Paris?"}]
    message = claude.messages.create(
        model="chat", messages=question, max_tokens=50, tools=[WEATHER], tool_choice={"type": "any"}
    )
    assert message.stop_reason == "tool_use"
    (use,) = message.content
    assert (use.type, use.id, use.name, use.input) == ("tool_use", "call_1", "weather", {"city": "Paris"})
    sent = replica.requests[-1]
    assert sent["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "weather",
                "parameters": WEATHER["input_schema"],
                "description": WEATHER["description"],
            },
        }
    ]
    assert sent["tool_choice"] == "required"

    with claude.messages.stream(model="chat", messages=question, max_tokens=50, tools=[WEATHER]) as stream:
        deltas = [e.delta.partial_json for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "".join(deltas) == '{"city": "Paris"}' and len(deltas) == 2
    assert final.content[0].input == {"city": "Paris"} and final.stop_reason == "tool_use"

    replica.tool_call = None
    answer = claude.messages.create(
        model="chat",
        max_tokens=50,
        tools=[WEATHER],
        messages=[
            *question,
            {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "Sunny"}]},
        ],
    )
    assert answer.content[0].text == "ok"
    assert replica.requests[-1]["messages"][1:] == [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
    ]


def test_a_key_is_taken_as_x_api_key_or_as_a_bearer_token(sdk_clients, gateway):
    _, claude, _ = sdk_clients
    secret = claude.api_key
    bearer = anthropic.Anthropic(base_url=gateway.url, auth_token=secret, max_retries=0)
    for each in (claude, bearer):
        assert each.messages.create(model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=5).id


def test_anthropics_client_raises_its_own_error_for_each_refusal_in_anthropics_shape(sdk_clients, gateway):
    replica, claude, _ = sdk_clients
    hi = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude.messages.create(model="chat", messages=hi, max_tokens=0)
    assert bad.value.body["type"] == "error" and bad.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in bad.value.body["error"]["message"]
    wrong = anthropic.Anthropic(base_url=gateway.url, api_key="llmgw-not-a-key", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as unknown:
        wrong.messages.create(model="chat", messages=hi, max_tokens=5)
    assert unknown.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.create(model="nothing-like-it", messages=hi, max_tokens=5)
    assert missing.value.body["error"]["type"] == "not_found_error" and "nothing-like-it" in str(missing.value)
    replica.status = 429
    with pytest.raises(anthropic.RateLimitError) as limited:
        claude.messages.create(model="chat", messages=hi, max_tokens=5)
    assert limited.value.body == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": "the replica answers 429"},
    }
    # Without max_tokens, which Anthropic requires, the sentence says so.
    raw = requests.post(
        gateway.url + "/v1/messages", json={"model": "chat", "messages": hi}, headers={"x-api-key": claude.api_key}
    )
    assert raw.status_code == 400 and "max_tokens" in raw.json()["error"]["message"]


# --- OpenAI Responses ---------------------------------------------------------------------


def test_a_response_goes_to_the_engine_as_a_chat_and_comes_back_in_the_responses_shape(sdk_clients):
    replica, _, gpt = sdk_clients
    response = gpt.responses.create(
        model="assistant", instructions="Be brief.", input="hi", max_output_tokens=20, temperature=0.5, top_p=0.9
    )
    assert response.object == "response" and response.status == "completed" and response.model == "assistant"
    assert response.output_text == "ok"
    assert (response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens) == (11, 3, 14)
    sent = replica.requests[-1]
    assert sent["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert (sent["model"], sent["max_tokens"], sent["temperature"], sent["top_p"]) == ("chat", 20, 0.5, 0.9)

    items = [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]
    assert gpt.responses.create(model="chat", input=items).output_text == "ok"
    assert replica.requests[-1]["messages"] == [{"role": "user", "content": "hi"}]


def test_a_streamed_response_comes_as_the_responses_events_in_order_with_usage(sdk_clients):
    _, _, gpt = sdk_clients
    events = list(gpt.responses.create(model="chat", input="hi", stream=True))
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[7].text == "c0c1c2"
    completed = events[-1].response
    assert completed.output_text == "c0c1c2" and completed.usage.total_tokens == 14


def test_a_tool_call_is_a_function_call_item_whole_and_streamed_and_its_output_goes_back(sdk_clients):
    replica, _, gpt = sdk_clients
    replica.tool_call = {"name": "weather", "arguments": json.dumps({"city": "Paris"})}
    response = gpt.responses.create(model="chat", input="Weather in Paris?", tools=[WEATHER_FUNCTION])
    (call,) = response.output
    assert (call.type, call.call_id, call.name, call.arguments) == (
        "function_call",
        "call_1",
        "weather",
        '{"city": "Paris"}',
    )
    assert replica.requests[-1]["tools"][0]["function"]["name"] == "weather"

    events = list(gpt.responses.create(model="chat", input="Weather in Paris?", tools=[WEATHER_FUNCTION], stream=True))
    kinds = [e.type for e in events]
    assert kinds[2:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[5].arguments == '{"city": "Paris"}' and events[-1].response.output[0].name == "weather"

    replica.tool_call = None
    answer = gpt.responses.create(
        model="chat",
        tools=[WEATHER_FUNCTION],
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": call.arguments},
            {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"},
        ],
    )
    assert answer.output_text == "ok"
    assert replica.requests[-1]["messages"][1:] == [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": call.arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
    ]


def test_openais_client_raises_its_own_error_for_each_refusal_and_stored_responses_are_a_clear_400(
    sdk_clients, gateway
):
    replica, _, gpt = sdk_clients
    with pytest.raises(openai.BadRequestError) as stored:
        gpt.responses.create(model="chat", input="hi", previous_response_id="resp_123", store=True)
    assert "keeps no responses" in stored.value.message and stored.value.code == "stored_responses_unsupported"
    with pytest.raises(openai.BadRequestError):
        gpt.responses.create(model="chat", input="hi", tools=[{"type": "web_search"}])
    wrong = openai.OpenAI(base_url=gateway.url + "/v1", api_key="llmgw-not-a-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as unknown:
        wrong.responses.create(model="chat", input="hi")
    assert unknown.value.code == "invalid_api_key"
    with pytest.raises(openai.NotFoundError) as missing:
        gpt.responses.create(model="nothing-like-it", input="hi")
    assert missing.value.code == "model_not_found"
    replica.status = 429
    with pytest.raises(openai.RateLimitError):
        gpt.responses.create(model="chat", input="hi")


def test_both_apis_are_counted_as_usage_streamed_or_not(sdk_clients):
    _, claude, gpt = sdk_clients
    claude.messages.create(model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    list(claude.messages.create(model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True))
    gpt.responses.create(model="chat", input="hi")
    list(gpt.responses.create(model="chat", input="hi", stream=True))

    def counted():
        row = Usage.objects.filter(key__name="clients", model_name="chat").first()
        return row if row is not None and row.requests == 4 else None

    row = wait_until(counted, timeout=10, what="four requests counted")
    assert (row.prompt_tokens, row.completion_tokens) == (44, 12)


def test_structured_output_is_asked_of_the_engine_as_chats_response_format(sdk_clients):
    replica, _, gpt = sdk_clients
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    gpt.responses.create(
        model="chat", input="hi", text={"format": {"type": "json_schema", "name": "place", "schema": schema}}
    )
    assert replica.requests[-1]["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "place", "schema": schema},
    }


def test_a_replicas_refusal_of_a_streamed_request_is_the_clients_own_error_and_odd_blocks_are_named(
    sdk_clients, gateway
):
    replica, claude, gpt = sdk_clients
    replica.status = 400
    with pytest.raises(anthropic.BadRequestError) as refused:
        list(
            claude.messages.create(
                model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True
            )
        )
    assert refused.value.body["error"] == {"type": "invalid_request_error", "message": "the replica answers 400"}
    with pytest.raises(openai.BadRequestError) as also:
        list(gpt.responses.create(model="chat", input="hi", stream=True))
    assert also.value.message.endswith("the replica answers 400")
    replica.status = 200
    image = {"type": "image", "source": {"type": "url", "url": "http://127.0.0.1:1/cat.png"}}
    with pytest.raises(anthropic.BadRequestError) as odd:
        claude.messages.create(model="chat", messages=[{"role": "user", "content": [image]}], max_tokens=5)
    assert "'image'" in odd.value.body["error"]["message"]
    nothing = requests.post(gateway.url + "/v1/messages/count_tokens", json={}, headers={"x-api-key": claude.api_key})
    assert nothing.status_code == 404 and nothing.json()["error"]["type"] == "not_found_error"


def test_a_client_that_hangs_up_mid_stream_closes_the_replicas_connection_on_both_apis(sdk_clients, gateway):
    replica, claude, _ = sdk_clients
    replica.hold = True
    bodies = {
        "/v1/messages": {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5},
        "/v1/responses": {"model": "chat", "input": "hi"},
    }
    for n, (path, body) in enumerate(bodies.items(), start=1):
        with requests.post(
            gateway.url + path,
            json={**body, "stream": True},
            headers={"x-api-key": claude.api_key},
            stream=True,
            timeout=30,
        ) as held:
            first = next(held.iter_lines())
            assert first.startswith(b"event: ")  # message_start or response.created, the first chunk translated
        wait_until(lambda n=n: replica.hung_up == n, timeout=10, what=f"the replica to see {path}'s client leave")
