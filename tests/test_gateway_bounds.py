"""Bounds a client cannot get around: the output limit, token windows, hang-ups, big bodies, hold queues, the cache.

Each test performs the attack through a real gateway process (`manage.py gateway`): fake
replicas (tests/fake_replica.py, real HTTP servers that record what they are sent) where
the engine's behaviour is not the point, the real llama-server where it is (its prompt cache).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import pytest
import requests

from agent import engines
from catalog.models import Model, Profile
from contracts import demand
from fleet.models import Node, Replica
from gateway.keys import create_key
from gateway.limits import used_now
from gateway.models import Usage

from . import real_model
from .scrape import samples, total
from .support.factories import add_model, add_replica
from .support.gateway import chat, clear_of_minute_boundary, client, error_of, held_stream, until_routed
from .support.gateway_process import start_gateway
from .support.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

MAX_BODY = 32 * 1024 * 1024


@pytest.fixture
def gateway_with(transactional_db, tmp_path):
    """`gateway_with(**env)`: a gateway process with these settings; stopped afterwards."""
    made = []

    def make(**env):
        directory = tmp_path / f"g{len(made)}"
        directory.mkdir()
        process, url = start_gateway(directory, **env)
        made.append(process)
        return url

    yield make
    for process in made:
        process.stop()


def empty_objects_body(size: int = MAX_BODY - 1024) -> bytes:
    """A chat body of about `size` bytes whose messages are `{},{},...`: eleven million objects in 32 MiB."""
    head, tail = b'{"model": "chat", "messages": [', b"{}]}"
    return head + b"{}," * ((size - len(head) - len(tail)) // 3) + tail


def usage_of(key_name: str) -> Usage | None:
    return Usage.objects.filter(key__name=key_name).first()


# --- the output limit ---------------------------------------------------------------------------


def test_a_request_without_max_tokens_reaches_the_engine_with_the_models_output_limit_on_every_endpoint(
    gateway, replicas
):
    add_model(max_output=64)
    replica = replicas()
    add_replica("chat", replica.base)
    _, secret = create_key("k")
    session = client(secret)
    until_routed(session, gateway.url)

    assert chat(session, gateway.url).status_code == 200
    assert replica.requests[-1]["max_tokens"] == 64
    assert chat(session, gateway.url, stream=True).status_code == 200
    assert replica.requests[-1]["max_tokens"] == 64
    completion = session.post(gateway.url + "/v1/completions", json={"model": "chat", "prompt": "hi"}, timeout=30)
    assert completion.status_code == 200 and replica.requests[-1]["max_tokens"] == 64
    responses = session.post(gateway.url + "/v1/responses", json={"model": "chat", "input": "hi"}, timeout=30)
    assert responses.status_code == 200, responses.text
    assert replica.requests[-1]["max_tokens"] == 64
    # A smaller one is the client's to choose; a larger one is refused with the limit.
    assert chat(session, gateway.url, max_tokens=10).status_code == 200
    assert replica.requests[-1]["max_tokens"] == 10
    messages = session.post(
        gateway.url + "/v1/messages",
        json={"model": "chat", "max_tokens": 1000, "messages": [{"role": "user", "content": "hi"}]},
        timeout=30,
    )
    assert messages.status_code == 400 and "output limit of chat, which is 64 tokens" in messages.text


def test_the_prompt_guard_reads_tools_and_every_input_of_an_embedding_not_only_messages(gateway, replicas):
    add_model(context_length=16)  # at most 16 x 256 = 4,096 characters can fit
    embedder = add_model("embedder", context_length=16)
    Model.objects.filter(pk=embedder.pk).update(kind="embedding")
    replica = replicas()
    add_replica("chat", replica.base)
    add_replica("embedder", replica.base)
    _, secret = create_key("k")
    session = client(secret)
    until_routed(session, gateway.url)
    until_routed(session, gateway.url, "embedder")

    tools = [{"type": "function", "function": {"name": "f", "description": "x" * 5000, "parameters": {}}}]
    hidden = chat(session, gateway.url, tools=tools, max_tokens=4)
    assert hidden.status_code == 400 and error_of(hidden)["code"] == "context_length_exceeded", hidden.text
    embedding = session.post(
        gateway.url + "/v1/embeddings", json={"model": "embedder", "input": ["short", "y" * 5000]}, timeout=30
    )
    assert embedding.status_code == 400, embedding.text
    error = error_of(embedding)
    assert error["code"] == "context_length_exceeded" and error["param"] == "input"
    assert error["message"].startswith("An item of 'input' is 5000 characters long")
    assert replica.requests == []


# --- token windows ------------------------------------------------------------------------------


def test_thirty_concurrent_requests_against_a_100_token_window_admit_no_more_than_fits(gateway, replicas, redis_client):
    add_model()
    replica = replicas()
    replica.hold = True  # every stream stays open after its first chunk: all thirty are in flight at once
    replica.usage = {"prompt_tokens": 5, "completion_tokens": 10}
    add_replica("chat", replica.base)
    key, secret = create_key("window", limits={"tokens_per_minute": 100})
    session = client(secret)
    until_routed(session, gateway.url)
    body = {
        "model": "chat",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 10,
        "stream": True,
        "stream_options": {"include_usage": True},  # so the body goes to the engine as it is
    }
    reserved = -(-len(json.dumps(body)) // 4) + 10  # its prompt by its body's size, and its max_tokens
    clear_of_minute_boundary(30)

    def send(_) -> requests.Response:
        return requests.post(
            gateway.url + "/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {secret}"},
            stream=True,
            timeout=30,
        )

    with ThreadPoolExecutor(30) as pool:
        answers = list(pool.map(send, range(30)))
    statuses = [a.status_code for a in answers]
    fits = 100 // reserved
    assert statuses.count(200) == fits and statuses.count(429) == 30 - fits, (reserved, statuses)
    refused = next(a for a in answers if a.status_code == 429)
    assert "used or reserved in this window, and this request may use" in error_of(refused)["message"]
    assert used_now(redis_client, key.key_hash)["tokens_per_minute"] == fits * reserved

    replica.release.set()
    for answer in answers:
        assert answer.content  # read to its end
    # Settled to what the answers used, 15 tokens each, in place of what they reserved.
    wait_until(
        lambda: used_now(redis_client, key.key_hash)["tokens_per_minute"] == fits * 15,
        timeout=10,
        what="the reservations to settle to the answers' usage",
    )


def test_a_client_that_hangs_up_is_billed_for_the_prompt_it_sent_however_it_hid_it(gateway, replicas):
    add_model(context_length=100_000)
    replica = replicas()
    add_replica("chat", replica.base)
    _, streamer = create_key("streamer")
    _, waiter = create_key("waiter")
    until_routed(client(streamer), gateway.url)
    # The prompt hidden in a tool's description: the template puts it before the engine all the same.
    tools = [{"type": "function", "function": {"name": "f", "description": "x" * 40_000, "parameters": {}}}]

    streamed = requests.post(
        gateway.url + "/v1/chat/completions",
        json={
            "model": "chat",
            "messages": [{"role": "user", "content": "hi"}],
            "tools": tools,
            "stream": True,
            "hold": True,
        },
        headers={"Authorization": f"Bearer {streamer}"},
        stream=True,
        timeout=30,
    )
    assert streamed.status_code == 200
    next(streamed.iter_content(None))  # the first chunk; the usage chunk would come last
    streamed.close()
    wait_until(lambda: replica.hung_up == 1, timeout=10, what="the engine to see the hang-up")

    # Not streamed: the client leaves while the answer is on its way, before its usage.
    whole = requests.post(
        gateway.url + "/v1/chat/completions",
        json={"model": "chat", "messages": [{"role": "user", "content": "hi"}], "tools": tools, "hold": True},
        headers={"Authorization": f"Bearer {waiter}"},
        stream=True,
        timeout=30,
    )
    assert whole.status_code == 200
    whole.close()
    wait_until(lambda: replica.hung_up == 2, timeout=10, what="the engine to see the second hang-up")

    for name in ("streamer", "waiter"):
        row = wait_until(lambda name=name: usage_of(name), timeout=15, what=f"{name}'s usage to be written")
        assert row.requests == 1
        assert row.prompt_tokens >= 40_000 // 4, (name, row.prompt_tokens)


# --- admission before work -------------------------------------------------------------------------


def _whole_response(sock: socket.socket) -> bytes:
    """One HTTP response read whole: its head, then its body up to Content-Length or the close.

    The head and the body may come in separate reads; a reset after the answer (the gateway
    closes without reading the rest of the body) ends the reading with what came.
    """
    answer = b""
    try:
        while b"\r\n\r\n" not in answer:
            chunk = sock.recv(65536)
            if not chunk:
                return answer
            answer += chunk
        head = answer.partition(b"\r\n\r\n")[0]
        length = next(
            (
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            ),
            None,
        )
        while length is None or len(answer) - len(head) - 4 < length:
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
        return answer
    except (ConnectionResetError, BrokenPipeError):
        return answer


def test_a_32_mib_body_from_a_key_at_its_one_request_a_minute_is_refused_before_it_is_read(gateway, replicas):
    add_model()
    add_replica("chat", replicas().base)
    _, secret = create_key("slow", limits={"requests_per_minute": 1})
    session = client(secret)
    until_routed(session, gateway.url)
    clear_of_minute_boundary(20)
    assert chat(session, gateway.url).status_code == 200

    body = empty_objects_body()
    address = urlsplit(gateway.url)
    with socket.create_connection((address.hostname, address.port), timeout=10) as raw:
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {secret}\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        # Only the first 64 KiB of the 32 MiB: the answer comes without the rest.
        raw.sendall(head.encode() + body[:65536])
        answer = _whole_response(raw)
    assert answer.startswith(b"HTTP/1.1 429"), answer[:200]
    assert b"over its limit of 1 requests per minute" in answer


def test_a_stream_keeps_flowing_while_an_allowed_key_sends_32_mib_bodies_of_empty_objects(gateway, replicas):
    add_model()
    replica = replicas()
    replica.chunks = 100
    add_replica("chat", replica.base)
    _, secret = create_key("k")
    session = client(secret)
    until_routed(session, gateway.url)

    # A chunk every 50 ms, five seconds in all.
    stream = session.post(
        gateway.url + "/v1/chat/completions",
        json={"model": "chat", "messages": [{"role": "user", "content": "hi"}], "stream": True, "gap": 0.05},
        stream=True,
        timeout=60,
    )
    arrivals: list[float] = []
    reader_done = threading.Event()

    def read() -> None:
        for _ in stream.iter_content(None):
            arrivals.append(time.monotonic())
        reader_done.set()

    body = empty_objects_body()
    big = requests.Session()
    big.headers.update({"Authorization": f"Bearer {secret}", "Content-Type": "application/json"})
    reader = threading.Thread(target=read)
    reader.start()
    wait_until(lambda: arrivals, timeout=10, what="the stream's first chunk")
    answered = [big.post(gateway.url + "/v1/chat/completions", data=body, timeout=60) for _ in range(2)]
    finished_at = time.monotonic()
    reader.join(60)
    assert reader_done.is_set()
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    # Generous: a chunk comes every 50 ms; a parse of eleven million objects on the event loop took seconds.
    assert max(gaps) < 1.0, f"the stream stalled for {max(gaps):.2f} s"
    assert finished_at < arrivals[-1], "the big bodies were not sent while the stream ran"
    for answer in answered:
        assert answer.status_code == 413, answer.text[:300]
        assert "JSON objects and arrays" in error_of(answer)["message"]


def test_a_key_without_limits_of_its_own_has_at_most_its_processs_share_of_requests_at_once(gateway_with, replicas):
    url = gateway_with(LLMGW_GATEWAY_KEY_CONCURRENCY=2)
    add_model()
    replica = replicas()
    add_replica("chat", replica.base)
    _, greedy = create_key("greedy")
    _, other = create_key("other")
    until_routed(client(greedy), url)
    held = [held_stream(url, greedy) for _ in range(2)]
    assert [h.status_code for h in held] == [200, 200]
    third = chat(client(greedy), url)
    assert third.status_code == 429, third.text
    assert error_of(third)["message"] == (
        "This API key has 2 requests in this gateway process already, as many as it takes from one key at once "
        "(LLMGW_GATEWAY_KEY_CONCURRENCY)."
    )
    assert chat(client(other), url).status_code == 200
    replica.release.set()
    for stream in held:
        assert stream.content.endswith(b"data: [DONE]\n\n")
    assert chat(client(greedy), url).status_code == 200


def waiting(redis_client, model="chat") -> int:
    """Requests waiting for a replica of `model`, as the gateway processes write them to Redis."""
    snapshots = [demand.decode(raw) for raw in redis_client.hgetall(demand.LOAD_KEY).values()]
    return sum(s["models"].get(model, {}).get("waiting", 0) for s in snapshots if s)


def test_a_key_cannot_take_more_than_its_share_of_a_models_hold_queue(gateway_with, replicas, redis_client):
    url = gateway_with(LLMGW_HOLD_QUEUE_PER_KEY=2)
    model = add_model()
    Model.objects.filter(pk=model.pk).update(scaling_min=0, scaling_max=1)  # at zero: requests wait for a wake
    _, greedy = create_key("greedy")
    _, other = create_key("other")
    results: list = []

    def ask(secret: str) -> None:
        results.append(chat(client(secret), url))

    threads = []
    for n, secret in enumerate((greedy, greedy)):
        threads.append(threading.Thread(target=ask, args=(secret,)))
        threads[-1].start()
        wait_until(lambda n=n: waiting(redis_client) == n + 1, timeout=10, what=f"request {n} to wait")
    refused = client(greedy).post(url + "/v1/chat/completions", json={"model": "chat", "messages": []}, timeout=10)
    assert refused.status_code == 503, refused.text
    error = error_of(refused)
    assert error["code"] == "hold_queue_full"
    assert error["message"].startswith("This API key has 2 requests waiting for a replica of chat already")
    # Another key still gets its place in the queue.
    threads.append(threading.Thread(target=ask, args=(other,)))
    threads[-1].start()
    wait_until(lambda: waiting(redis_client) == 3, timeout=10, what="the other key's request to wait")

    add_replica("chat", replicas().base)
    for thread in threads:
        thread.join(30)
    assert [r.status_code for r in results] == [200, 200, 200]


# --- no oracle of other keys' prompts --------------------------------------------------------------


@pytest.mark.engine
def test_a_key_cannot_learn_from_cached_tokens_what_another_key_sent_to_a_real_llama_server(
    tmp_path, tiny_gguf, gateway_with
):
    process, endpoint, _ = real_model.start_engine(tiny_gguf, tmp_path, ["--parallel", "1"])
    try:
        model = Model.objects.create(name=real_model.MODEL, source="http://127.0.0.1:1/tiny/", context_length=256)
        Profile.objects.create(model=model, name="cpu", engine="llamacpp")
        Replica.objects.create(
            model_name=real_model.MODEL,
            profile_name="cpu",
            node=Node.objects.create(name="n1"),
            state="ready",
            endpoint=endpoint,
        )
        url = gateway_with(LLMGW_METRICS_TOKEN="bounds-metrics")
        _, alice = create_key("alice")
        _, mallory = create_key("mallory")
        until_routed(client(alice), url, real_model.MODEL)
        # About a hundred tokens of the tiny model's (its context is 256).
        secret_prompt = "The launch code is " + " ".join(str(i % 10) for i in range(40))
        body = {"model": real_model.MODEL, "messages": [{"role": "user", "content": secret_prompt}], "max_tokens": 4}

        first = client(alice).post(url + "/v1/chat/completions", json=body, timeout=120)
        assert first.status_code == 200, first.text
        # Mallory's guess: Alice's prompt. On the engine's one slot it is a cache hit, token for token.
        guessed = client(mallory).post(url + "/v1/chat/completions", json=body, timeout=120)
        assert guessed.status_code == 200, guessed.text
        usage = guessed.json()["usage"]
        assert usage["prompt_tokens"] > 50
        assert (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) == 0, usage
        assert not (guessed.json().get("timings") or {}), guessed.json().get("timings")
        streamed = client(mallory).post(
            url + "/v1/chat/completions",
            json={**body, "stream": True, "stream_options": {"include_usage": True}},
            timeout=120,
        )
        chunks = [json.loads(event) for event in real_model.stream_events(streamed) if event != "[DONE]"]
        assert any(chunk.get("usage") for chunk in chunks)
        for chunk in chunks:
            assert ((chunk.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0) == 0, chunk
            assert not (chunk.get("timings") or {}), chunk

        # The operator still sees the cache at work.
        scraped = requests.get(url + "/metrics", headers={"Authorization": "Bearer bounds-metrics"}, timeout=10)
        cached = total(samples(scraped.text), "llmgw_gateway_cached_prompt_tokens_total")
        assert cached > 50, scraped.text[:2000]
    finally:
        engines.stop_group(process.pid, grace=5)
