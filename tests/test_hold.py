"""Requests held for a model with no ready replica but one on its way, and the load the gateway shares.

A real gateway process (uvicorn) in front of replicas that answer on cue (tests/fake_replica.py,
real HTTP servers), the tests' real Redis as the broker: the wake a waiting request asks
for is read off the control queue itself, where no worker takes it in these tests. The
real engine and agent are in test_hold_real_model.py.
"""

from __future__ import annotations

import base64
import json
import socket
import threading
import time
from types import SimpleNamespace

import pytest
import requests

from catalog.models import Model
from contracts import demand
from contracts import progress as contracts_progress
from fleet.models import Replica
from gateway.keys import create_key

from .support.factories import add_model, add_replica
from .support.gateway import client, error_of
from .support.gateway_process import start_gateway as start_gateway_process
from .support.sdk import openai
from .support.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def start_gateway(tmp_path, **env):
    process, url = start_gateway_process(tmp_path, **env)
    return SimpleNamespace(url=url, process=process)


@pytest.fixture
def gateways(transactional_db, tmp_path):
    made = []

    def make(**env):
        gateway = start_gateway(tmp_path / f"g{len(made)}", **env)
        made.append(gateway)
        return gateway

    yield make
    for gateway in made:
        gateway.process.stop()


@pytest.fixture(autouse=True)
def tmp_dirs(tmp_path):
    for n in range(3):
        (tmp_path / f"g{n}").mkdir()


def at_zero(name="chat") -> Model:
    """A model scaled to zero: fewest 0, most 1, no replica."""
    model = add_model(name)
    Model.objects.filter(pk=model.pk).update(scaling_min=0, scaling_max=1)
    return model


def ask(url: str, secret: str, model="chat", stream=False, path="/v1/chat/completions", timeout=60, **extra):
    if path == "/v1/messages":
        body = {"model": model, "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
    elif path == "/v1/responses":
        body = {"model": model, "input": "hi"}
    elif path == "/v1/completions":
        body = {"model": model, "prompt": "hi"}
    else:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    body.update(extra)
    if stream:
        body["stream"] = True
    return requests.post(
        url + path, json=body, headers={"Authorization": f"Bearer {secret}"}, stream=stream, timeout=timeout
    )


def load_of(redis_client) -> list[dict]:
    """Every gateway process's snapshot in Redis, as the control plane reads them."""
    return [demand.decode(raw) for raw in redis_client.hgetall(demand.LOAD_KEY).values()]


def waiting(redis_client, model="chat") -> int:
    return sum(s["models"].get(model, {}).get("waiting", 0) for s in load_of(redis_client) if s)


def wakes_sent(redis_client) -> list[list]:
    """The fleet.wake tasks on the control queue (kombu's Redis transport: a list of JSON messages)."""
    found = []
    for raw in redis_client.lrange("control", 0, -1):
        message = json.loads(raw)
        if message["headers"]["task"] == demand.WAKE:
            found.append(json.loads(base64.b64decode(message["body"]))[0])
    return found


def in_background(call):
    box = {}

    def run():
        try:
            box["result"] = call()
        except requests.RequestException as error:  # the gateway stopped at the test's end
            box["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    box["thread"] = thread
    return box


# --- waiting and waking -------------------------------------------------------------------


def test_concurrent_requests_for_a_model_at_zero_wait_ask_once_to_wake_and_all_go_once_a_replica_is_ready(
    gateways, replicas, redis_client
):
    gateway = gateways()
    at_zero()
    redis_client.delete("control")
    _, secret = create_key("k")
    waiters = []
    for n in range(6):
        waiters.append(in_background(lambda n=n: ask(gateway.url, secret, n=n)))
        wait_until(lambda n=n: waiting(redis_client) == n + 1, timeout=10, what=f"request {n} to wait")
    # Six waiting, one wake asked for: the key set once, one task on the control queue.
    assert redis_client.ttl(demand.wake_key("chat")) > 0
    assert wakes_sent(redis_client) == [["chat"]]
    assert not any("result" in w or "error" in w for w in waiters)

    fake = replicas()
    add_replica("chat", fake.base)
    for w in waiters:
        w["thread"].join(30)
    assert [w["result"].status_code for w in waiters] == [200] * 6
    # Each went once (the order they go in is test_hold_real_model.py's: this replica shares the GIL).
    assert sorted(body["n"] for body in fake.requests) == list(range(6))
    wait_until(lambda: waiting(redis_client) == 0, timeout=5, what="the waiting count back to 0")
    assert wakes_sent(redis_client) == [["chat"]]


def test_a_full_queue_is_a_503_that_says_so(gateways, redis_client):
    gateway = gateways(LLMGW_HOLD_QUEUE=2)
    at_zero()
    _, secret = create_key("k")
    for n in range(2):
        in_background(lambda: ask(gateway.url, secret))
        wait_until(lambda n=n: waiting(redis_client) == n + 1, timeout=10, what="a request to wait")
    refused = ask(gateway.url, secret)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
    error = error_of(refused)
    assert error["code"] == "hold_queue_full"
    assert error["message"].startswith("2 requests are already waiting for a replica of chat"), error
    assert "chat is scaled to zero and is being woken" in error["message"]


def test_a_wait_past_llmgw_hold_s_is_a_503_with_retry_after_and_the_replicas_progress(gateways, redis_client):
    gateway = gateways(LLMGW_HOLD_S=2)
    add_model()
    source = "http://127.0.0.1:1/chat/v1/"
    replica = add_replica("chat", "", state="fetching", source=source)
    snapshot = {"state": "fetching", "bytes_done": 43, "bytes_total": 100, "node": "n1", "source": source}
    redis_client.hset(contracts_progress.progress_key("n1"), source, json.dumps(snapshot))
    _, secret = create_key("k")
    began = time.monotonic()
    answer = ask(gateway.url, secret)
    waited = time.monotonic() - began
    assert answer.status_code == 503 and answer.headers["retry-after"] == "5"
    assert 2 <= waited < 10, waited
    message = error_of(answer)["message"]
    assert f"replica {replica.pk} on n1 is fetching 43%" in message and "Waited 2 s" in message, message


def sse(response) -> list[str]:
    """Every line of an event stream, as read through a whole, well-ended chunked response."""
    return [line for line in response.iter_lines(decode_unicode=True)]


@pytest.mark.parametrize(
    "path, says",
    [
        ("/v1/chat/completions", "data: [DONE]"),
        ("/v1/completions", "data: [DONE]"),
        ("/v1/messages", "event: error"),
        ("/v1/responses", "event: error"),
    ],
)
def test_a_streamed_request_gets_comments_while_it_waits_then_an_error_event_in_its_own_format(
    gateways, redis_client, path, says
):
    gateway = gateways(LLMGW_HOLD_S=5)
    add_model()
    source = "http://127.0.0.1:1/chat/v1/"
    add_replica("chat", "", state="fetching", source=source)
    snapshot = {"state": "fetching", "bytes_done": 43, "bytes_total": 100, "node": "n1", "source": source}
    redis_client.hset(contracts_progress.progress_key("n1"), source, json.dumps(snapshot))
    _, secret = create_key("k")
    with ask(gateway.url, secret, stream=True, path=path) as response:
        assert response.status_code == 200 and response.headers["content-type"] == "text/event-stream"
        lines = sse(response)
    comments = [line for line in lines if line.startswith(":")]
    assert comments and set(comments) == {": waiting for a replica of chat: fetching 43%"}, lines
    assert len(comments) >= 2, lines  # the first after a second, then one every three
    assert says in lines, lines
    data = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert len(data) == 1, lines
    message = data[0]["error"]["message"] if "error" in data[0] else data[0]["message"]
    assert "fetching 43%" in message and "Waited 5 s" in message, message


def test_a_client_that_hangs_up_while_waiting_leaves_the_queue(gateways, redis_client):
    gateway = gateways(LLMGW_HOLD_QUEUE=1)
    at_zero()
    _, secret = create_key("k")
    port = int(gateway.url.rsplit(":", 1)[1])
    body = json.dumps({"model": "chat", "messages": [], "stream": True}).encode()
    raw = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {secret}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(raw)
    wait_until(lambda: waiting(redis_client) == 1, timeout=10, what="the request to wait")
    sock.settimeout(10)
    said = b""
    while b": waiting for a replica" not in said:
        said += sock.recv(4096)
    assert b": waiting for a replica of chat: scaled to zero, waking" in said
    sock.close()
    wait_until(lambda: waiting(redis_client) == 0, timeout=5, what="the hung-up request to leave the queue")
    # Its place is free: the queue of one takes the next request instead of refusing it.
    box = in_background(lambda: ask(gateway.url, secret, timeout=30))
    wait_until(lambda: waiting(redis_client) == 1, timeout=10, what="the next request to wait")
    assert "result" not in box and "error" not in box


# --- what /v1/models says ----------------------------------------------------------------


def test_models_say_whether_each_is_ready_can_wake_or_cannot_and_a_model_that_cannot_is_refused_at_once(
    gateways, replicas
):
    gateway = gateways()
    add_model("ready")
    add_replica("ready", replicas().base)
    at_zero("asleep")
    off = add_model("off")
    Model.objects.filter(pk=off.pk).update(scaling_min=0, scaling_max=0)
    add_model("broken")
    broken = add_replica("broken", "", state="failed", reason="the engine exited with code 132")
    Replica.objects.filter(pk=broken.pk).update(attempts=3)
    _, secret = create_key("k")
    gpt = openai.OpenAI(base_url=gateway.url + "/v1", api_key=secret, max_retries=0)
    wait_until(lambda: any(m.id == "ready" and m.ready for m in gpt.models.list()), timeout=10, what="routing")
    listed = {m.id: m.llmgw for m in gpt.models.list()}  # the official client reads the list as ever
    assert listed["ready"] == {"state": "ready"}
    assert listed["asleep"] == {"state": "can wake", "reason": "asleep is scaled to zero and is being woken."}
    assert listed["off"] == {"state": "cannot", "reason": "off may run no replica (its most is 0)."}
    assert listed["broken"]["state"] == "cannot"
    assert (
        f"replica {broken.pk} on n1 failed 3 times in a row: the engine exited with code 132"
        in (listed["broken"]["reason"])
    )
    began = time.monotonic()
    refused = ask(gateway.url, secret, model="off")
    assert refused.status_code == 503 and time.monotonic() - began < 2
    assert error_of(refused)["message"] == "off may run no replica (its most is 0)."


# --- the load shared with the control plane ---------------------------------------------


def test_the_gateway_writes_its_requests_in_flight_per_model_and_replica_to_redis_every_second(
    gateways, replicas, redis_client
):
    gateway = gateways()
    add_model()
    fake = replicas()
    replica = add_replica("chat", fake.base)
    _, secret = create_key("k")
    session = client(secret)
    wait_until(lambda: session.get(gateway.url + "/v1/models").json()["data"][0]["ready"], what="routing")
    before = time.time()
    held = ask(gateway.url, secret, stream=True, hold=True)

    def snapshot_with_one_in_flight():
        snapshots = [s for s in load_of(redis_client) if s and s["models"].get("chat", {}).get("in_flight") == 1]
        return snapshots[0] if snapshots else None

    snapshot = wait_until(snapshot_with_one_in_flight, timeout=5, what="the load in Redis")
    assert snapshot["replicas"] == {str(replica.pk): 1}
    assert snapshot["models"]["chat"]["waiting"] == 0 and snapshot["models"]["chat"]["last_request"] >= before
    fake.release.set()
    held.close()

    def idle():
        snapshots = [s for s in load_of(redis_client) if s and "chat" in s["models"]]
        return snapshots and snapshots[0]["models"]["chat"]["in_flight"] == 0 and snapshots[0]["replicas"] == {}

    wait_until(idle, timeout=5, what="the load back to 0")
    assert time.time() - max(s["at"] for s in load_of(redis_client)) < 2  # written every second, idle too
