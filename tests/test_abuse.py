"""Attacks and bad luck from issue 13, each done for real: a prompt too large for its model,
a stream hung up on before its usage, a busy engine taken for a dead one, slow clients
against the byte listener.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import requests

from gateway.intake import LONGEST_TOKEN_CHARS
from gateway.keys import create_key
from gateway.models import Usage

from .processes import start_byte_listener, wait_until
from .test_gateway import add_model, add_replica, client, error_of, replicas, until_routed  # noqa: F401

# --- 2. a prompt that cannot fit its model's context --------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_megabyte_prompt_is_refused_by_the_gateway_and_never_reaches_an_engine(gateway, replicas):  # noqa: F811
    add_model("chat", context_length=2048)
    fake = replicas()
    add_replica("chat", fake.base)
    _, secret = create_key("attacker")
    session = client(secret)
    until_routed(session, gateway.url)
    megabyte = "lorem ipsum " * 90_000
    attempts = {
        "/v1/chat/completions": [
            {"messages": [{"role": "user", "content": megabyte}]},
            # The same text cut into many messages and content parts adds up all the same.
            {"messages": [{"role": "user", "content": [{"type": "text", "text": megabyte[:400_000]}]}] * 3},
        ],
        "/v1/completions": [{"prompt": megabyte}, {"prompt": [megabyte[:600_000], megabyte[:600_000]]}],
    }
    for path, bodies in attempts.items():
        for body in bodies:
            answer = session.post(gateway.url + path, json={"model": "chat", **body}, timeout=30)
            assert answer.status_code == 400, answer.text
            error = error_of(answer)
            assert error["code"] == "context_length_exceeded"
            assert error["param"] == ("messages" if path == "/v1/chat/completions" else "prompt")
            assert "cannot fit" in error["message"] and "2048 tokens" in error["message"]
    assert fake.requests == [], "a prompt that cannot fit reached the engine"

    # A prompt that may fit by its length goes on: whether it fits in tokens is the engine's to say.
    fits = "x" * (2048 * LONGEST_TOKEN_CHARS - 100)
    answer = session.post(
        gateway.url + "/v1/chat/completions",
        json={"model": "chat", "messages": [{"role": "user", "content": fits}]},
        timeout=30,
    )
    assert answer.status_code == 200
    assert len(fake.requests) == 1


# --- 3. a stream hung up on just before its usage chunk ---------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_client_that_hangs_up_before_the_usage_chunk_is_billed_for_what_was_relayed(gateway, replicas):  # noqa: F811
    add_model("chat")
    fake = replicas()
    fake.chunks = 600
    add_replica("chat", fake.base)
    key, secret = create_key("dodger")
    until_routed(client(secret), gateway.url)
    prompt = "tell me a long story " * 20  # 420 characters
    body = {
        "model": "chat",
        "messages": [{"role": "user", "content": prompt}],
        "stream": True,
        # The replica sends every content chunk, then waits before its usage chunk, the last.
        "hold_after": fake.chunks - 1,
    }
    response = requests.post(
        gateway.url + "/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {secret}"},
        stream=True,
        timeout=30,
    )
    assert response.status_code == 200
    received = 0
    for line in response.iter_lines():
        if line.startswith(b"data: "):
            received += 1
            if received == 599:
                break
    response.close()  # hangs up, before the usage chunk
    wait_until(lambda: fake.hung_up == 1, timeout=10, what="the gateway to close the replica's stream")

    def billed():
        row = Usage.objects.filter(key=key, model_name="chat").first()
        return row if row and row.completion_tokens else None

    row = wait_until(billed, timeout=10, what="the usage to be written")
    assert row.requests == 1
    # Each content chunk is a token: all 600 went through the gateway, 599 reached the client.
    assert 599 <= row.completion_tokens <= 600
    # The prompt, estimated from its length: 420 characters at about four a token.
    assert row.prompt_tokens == 105
