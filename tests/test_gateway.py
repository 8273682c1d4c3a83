"""The /v1/ gateway as clients see it: a real gateway process (uvicorn) in front of replicas that answer on cue."""

from __future__ import annotations

import itertools
import json
import os
import socket
import threading
import time

import pytest
import requests

from catalog.models import Model
from gateway.keys import create_key
from gateway.models import ApiKey, Usage

from .services import free_port
from .support.factories import add_model, add_replica
from .support.gateway import chat, client, error_of, held_stream, until_routed
from .support.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_request_without_a_key_or_with_a_wrong_one_is_refused_in_openais_shape(gateway):
    add_model()
    for headers in ({}, {"Authorization": "Bearer llmgw-not-a-key"}, {"Authorization": "Basic abc"}):
        answer = requests.post(gateway.url + "/v1/chat/completions", json={"model": "chat"}, headers=headers)
        assert answer.status_code == 401
        assert error_of(answer)["code"] == "invalid_api_key"
        assert "server-timing" in answer.headers


def test_a_key_made_a_moment_ago_works_and_a_turned_off_key_stops_working(gateway, replicas):
    add_model()
    add_replica("chat", replicas().base)
    key, secret = create_key("fresh")
    # No waiting for the next refresh: an unknown key makes the gateway look again.
    assert chat(client(secret), gateway.url).status_code == 200
    ApiKey.objects.filter(pk=key.pk).update(active=False)
    wait_until(lambda: chat(client(secret), gateway.url).status_code == 401, timeout=5, what="the key to be refused")


def test_a_key_limited_to_some_models_sees_and_uses_only_those(gateway, replicas):
    add_model("chat")
    add_model("other")
    add_replica("chat", replicas().base)
    add_replica("other", replicas().base)
    _, secret = create_key("limited", ["chat"])
    session = client(secret)
    until_routed(session, gateway.url)
    assert [m["id"] for m in session.get(gateway.url + "/v1/models").json()["data"]] == ["chat"]
    refused = chat(session, gateway.url, model="other")
    assert refused.status_code == 403
    assert "may not use the model other" in error_of(refused)["message"]


# --- models and routing ---------------------------------------------------------------


def test_models_lists_names_and_aliases_with_whether_each_has_a_ready_replica(gateway, replicas):
    add_model("chat", aliases=["assistant"], max_output=512)
    add_model("waiting")
    add_replica("chat", replicas().base)
    _, secret = create_key("k")
    session = client(secret)
    until_routed(session, gateway.url)
    listed = {m["id"]: m for m in session.get(gateway.url + "/v1/models").json()["data"]}
    assert (
        listed["chat"]["ready"] and listed["chat"]["aliases"] == ["assistant"] and listed["chat"]["max_output"] == 512
    )
    assert listed["assistant"]["ready"] and listed["assistant"]["alias_of"] == "chat"
    assert listed["waiting"]["ready"] is False
    assert listed["chat"]["llmgw"] == {"state": "ready"}
    assert listed["waiting"]["llmgw"] == {
        "state": "can wake",
        "reason": "No replica of waiting is placed yet; placement runs every few seconds.",
    }
    assert session.get(gateway.url + "/v1/models/assistant").json()["alias_of"] == "chat"


def test_an_alias_reaches_the_model_and_an_unknown_name_is_a_404(gateway, replicas):
    add_model("chat", aliases=["assistant"])
    replica = replicas()
    add_replica("chat", replica.base)
    _, secret = create_key("k")
    session = client(secret)
    until_routed(session, gateway.url)
    assert chat(session, gateway.url, model="assistant").json()["replica"] == "fake"
    assert replica.requests[-1]["model"] == "chat"
    missing = chat(session, gateway.url, model="nothing-like-it")
    assert missing.status_code == 404
    assert error_of(missing)["code"] == "model_not_found" and "nothing-like-it" in error_of(missing)["message"]


def test_the_replica_with_fewest_requests_in_flight_gets_the_next_one(gateway, replicas):
    add_model(routing="load")
    first, second = replicas("first"), replicas("second")
    add_replica("chat", first.base)
    add_replica("chat", second.base)
    _, secret = create_key("k")
    session = client(secret)
    until_routed(session, gateway.url)
    held = held_stream(gateway.url, secret)
    busy = held.headers["x-llmgw-replica"]
    for _ in range(6):
        answer = chat(session, gateway.url)
        assert answer.headers["x-llmgw-replica"] != busy
    first.release.set()
    second.release.set()
    held.close()


def test_profile_weights_share_the_streams_in_flight(gateway, replicas):
    add_model(profiles=(("big", 3), ("small", 1)))
    big, small = replicas("big"), replicas("small")
    add_replica("chat", big.base, profile="big")
    add_replica("chat", small.base, profile="small")
    _, secret = create_key("k")
    until_routed(client(secret), gateway.url)
    streams = []
    for _ in range(8):
        streams.append(held_stream(gateway.url, secret))
    wait_until(lambda: big.open_streams + small.open_streams == 8, timeout=10, what="eight open streams")
    assert (big.open_streams, small.open_streams) == (6, 2)
    big.release.set()
    small.release.set()
    for stream in streams:
        stream.close()


def test_a_profile_of_weight_zero_is_a_standby(gateway, replicas):
    add_model(profiles=(("main", 1), ("standby", 0)))
    main, standby = replicas("main"), replicas("standby")
    add_replica("chat", main.base, profile="main")
    add_replica("chat", standby.base, profile="standby")
    _, secret = create_key("k")
    until_routed(client(secret), gateway.url)
    streams = [held_stream(gateway.url, secret) for _ in range(4)]
    wait_until(lambda: main.open_streams == 4, timeout=10, what="four streams on the main replica")
    assert standby.requests == []
    main.release.set()
    for stream in streams:
        stream.close()
    # Where the main replica cannot be reached, the standby answers.
    add_model("spare", profiles=(("main", 1), ("standby", 0)))
    add_replica("spare", f"http://127.0.0.1:{free_port()}/v1", profile="main")
    add_replica("spare", standby.base, profile="standby")
    until_routed(client(secret), gateway.url, "spare")
    assert chat(client(secret), gateway.url, model="spare").json()["replica"] == "standby"


def test_a_replica_that_refuses_connections_is_passed_over_for_one_that_answers(gateway, replicas):
    add_model()
    dead = add_replica("chat", f"http://127.0.0.1:{free_port()}/v1")
    alive = replicas("alive")
    add_replica("chat", alive.base)
    _, secret = create_key("k")
    session = client(secret)
    until_routed(session, gateway.url)
    for _ in range(5):
        answer = chat(session, gateway.url)
        assert answer.status_code == 200 and answer.json()["replica"] == "alive"
        assert answer.headers["x-llmgw-replica"] != str(dead.pk)
    assert len(alive.requests) == 5


@pytest.fixture
def impatient_gateway(transactional_db, tmp_path):
    """A gateway whose requests wait a second for a replica (LLMGW_HOLD_S=1), not five minutes."""
    from types import SimpleNamespace

    from .support.gateway_process import start_gateway

    process, url = start_gateway(tmp_path, LLMGW_HOLD_S=1)
    yield SimpleNamespace(url=url, process=process)
    process.stop()


def test_when_no_replica_can_be_reached_the_client_is_told_which_and_why(impatient_gateway):
    add_model()
    dead = add_replica("chat", f"http://127.0.0.1:{free_port()}/v1")
    _, secret = create_key("k")
    session = client(secret)
    until_routed(session, impatient_gateway.url)
    # It waits for the replica to come back (gateway/hold.py), then says which did not answer and why.
    answer = chat(session, impatient_gateway.url)
    assert answer.status_code == 503 and answer.headers["retry-after"] == "5"
    message = error_of(answer)["message"]
    assert f"replica {dead.pk}" in message and "Waited 1 s" in message, message
    assert "The last try: No replica of chat could be reached" in message, message


class DroppingEngine:
    """An engine that answers the first request on each connection, keeps it alive, and drops it
    without a word when a second request comes on it, as llama-server's cpp-httplib does under load."""

    ANSWER = json.dumps(
        {
            "id": "x",
            "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
    ).encode()

    def __init__(self, together: int = 1):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.base = f"http://127.0.0.1:{self.listener.getsockname()[1]}/v1"
        self.answered = self.dropped = 0
        # The first `together` requests are answered only once all of them have come, each on a
        # connection of its own: the gateway's pool then holds that many the engine will drop.
        self.together = threading.Barrier(together)
        self.connections = itertools.count(1)
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self.converse, args=(connection,), daemon=True).start()

    def read_request(self, connection) -> bool:
        data = b""
        while b"\r\n\r\n" not in data:
            more = connection.recv(65536)
            if not more:
                return False
            data += more
        head, _, body = data.partition(b"\r\n\r\n")
        length = next(
            (int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")), 0
        )
        while len(body) < length:
            body += connection.recv(65536)
        return True

    def converse(self, connection):
        with connection:
            if not self.read_request(connection):
                return
            if next(self.connections) <= self.together.parties:
                try:
                    self.together.wait(timeout=30)
                except threading.BrokenBarrierError:
                    pass
            connection.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(self.ANSWER)}\r\n\r\n".encode()
                + self.ANSWER
            )
            self.answered += 1
            if connection.recv(1):  # the next request on this connection: let it go unanswered
                self.dropped += 1

    def stop(self):
        self.listener.close()


def test_an_engine_that_drops_a_kept_alive_connection_as_it_is_reused_still_answers(impatient_gateway):
    # The gateway used to take the drop for an engine gone, tried that replica last for 5 s and,
    # with no other, held every request meanwhile: 5 s stalls under steady load (bench/engine.py).
    engine = DroppingEngine()
    try:
        add_model()
        add_replica("chat", engine.base)
        _, secret = create_key("k")
        session = client(secret)
        until_routed(session, impatient_gateway.url)
        for turn in range(4):
            answer = chat(session, impatient_gateway.url)
            assert answer.status_code == 200, (turn, answer.text)
        assert engine.dropped >= 1, "the gateway never reused a connection, so nothing was tried"
    finally:
        engine.stop()


def test_a_request_resent_after_a_dropped_connection_goes_on_a_new_one_not_another_the_engine_dropped(
    impatient_gateway,
):
    # Under load the gateway's pool holds several kept-alive connections to one engine, and the
    # engine may have let all of them go: the resend used to take the next one from the pool,
    # fail again, and cool the only replica (bench/prefix.py's hot prefix: "Can not write request body").
    from concurrent.futures import ThreadPoolExecutor

    engine = DroppingEngine(together=3)
    try:
        add_model()
        add_replica("chat", engine.base)
        _, secret = create_key("k")
        until_routed(client(secret), impatient_gateway.url)
        with ThreadPoolExecutor(3) as pool:
            first = list(pool.map(lambda _: chat(client(secret), impatient_gateway.url), range(3)))
        assert [a.status_code for a in first] == [200, 200, 200]
        assert engine.together.n_waiting == 0 and not engine.together.broken, "three connections were not open at once"
        answer = chat(client(secret), impatient_gateway.url)
        assert answer.status_code == 200, answer.text
        assert engine.dropped >= 1, "the gateway never reused a connection, so nothing was tried"
    finally:
        engine.stop()


# --- refusals -----------------------------------------------------------------------


def test_no_ready_replica_is_a_503_that_says_why(impatient_gateway, redis_client):
    gateway = impatient_gateway
    from contracts import progress as contracts_progress

    add_model("chat")
    add_model("placing")
    source = "http://127.0.0.1:1/chat/v1/"
    replica = add_replica("chat", "", state="fetching", source=source)
    progress_snapshot = {"state": "fetching", "bytes_done": 43, "bytes_total": 100, "node": "n1", "source": source}
    redis_client.hset(contracts_progress.progress_key("n1"), source, json.dumps(progress_snapshot))
    add_replica("placing", "", state="pending", reason="no node has 64 GB of memory free")
    _, secret = create_key("k")
    session = client(secret)

    fetching = chat(session, gateway.url)
    assert fetching.status_code == 503 and fetching.headers["retry-after"] == "5"
    assert f"replica {replica.pk} on n1 is fetching 43%" in error_of(fetching)["message"]
    pending = chat(session, gateway.url, model="placing")
    assert "is pending: no node has 64 GB of memory free" in error_of(pending)["message"]
    add_model("nowhere")
    wait_until(lambda: chat(session, gateway.url, model="nowhere").status_code == 503, timeout=5, what="a 503")
    assert "No replica of nowhere is placed yet" in error_of(chat(session, gateway.url, model="nowhere"))["message"]


def test_max_tokens_above_the_output_limit_or_the_context_is_a_400(gateway, replicas):
    add_model(context_length=256, max_output=64)
    replica = replicas()
    add_replica("chat", replica.base)
    _, secret = create_key("k")
    session = client(secret)
    until_routed(session, gateway.url)
    above = chat(session, gateway.url, max_tokens=65)
    assert above.status_code == 400
    assert error_of(above)["message"] == "max_tokens is 65, above the output limit of chat, which is 64 tokens."
    add_model("long", context_length=256)
    add_replica("long", replica.base)
    until_routed(session, gateway.url, "long")
    no_room = chat(session, gateway.url, model="long", max_completion_tokens=256)
    assert no_room.status_code == 400 and error_of(no_room)["code"] == "context_length_exceeded"
    assert chat(session, gateway.url, max_tokens=64).status_code == 200
    assert len(replica.requests) == 1


@pytest.mark.parametrize(
    "body, says",
    [
        (b"{not json", "The request body is not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b'{"messages": []}', 'the request has no "model"'),
        (b'{"model": "chat", "max_tokens": "lots"}', '"max_tokens" must be a whole number'),
        (b'{"model": "chat", "stream": "yes"}', '"stream" must be true or false'),
    ],
)
def test_a_malformed_request_is_a_400_with_a_sentence(gateway, body, says):
    add_model()
    _, secret = create_key("k")
    answer = client(secret).post(gateway.url + "/v1/chat/completions", data=body)
    assert answer.status_code == 400, answer.text
    assert says in error_of(answer)["message"]


def test_completions_and_embeddings_reach_the_same_addresses_on_the_replica(gateway, replicas):
    add_model()
    Model.objects.filter(pk=add_model("embed").pk).update(kind="embedding")
    replica = replicas()
    add_replica("chat", replica.base)
    add_replica("embed", replica.base)
    _, secret = create_key("k")
    session = client(secret)
    until_routed(session, gateway.url, "embed")
    for path, body in (
        ("/v1/completions", {"model": "chat", "prompt": "x"}),
        ("/v1/embeddings", {"model": "embed", "input": "x"}),
        ("/v1/chat/completions", {"model": "chat", "messages": [{"role": "user", "content": "x"}]}),
    ):
        assert session.post(gateway.url + path, json=body).status_code == 200
    assert replica.paths == ["/v1/completions", "/v1/embeddings", "/v1/chat/completions"]


def test_a_body_over_the_limit_is_a_413_and_is_not_passed_on(tmp_path, transactional_db, replicas):
    from .support.gateway_process import start_gateway

    add_model()
    replica = replicas()
    add_replica("chat", replica.base)
    _, secret = create_key("k")
    process, url = start_gateway(tmp_path, LLMGW_GATEWAY_MAX_BODY=4096, LLMGW_GATEWAY_UPSTREAM_TIMEOUT_S=1)
    try:
        session = client(secret)
        until_routed(session, url)
        big = chat(session, url, messages=[{"role": "user", "content": "x" * 5000}])
        assert big.status_code == 413 and "larger than the gateway's limit of 4096 bytes" in error_of(big)["message"]
        assert replica.requests == []
        # And a replica that does not begin to answer within the timeout is a 504 that says so.
        slow = chat(session, url, delay=3)
        assert slow.status_code == 504 and "did not start answering within 1 s" in error_of(slow)["message"]
    finally:
        process.stop()


def test_anything_but_the_four_addresses_is_a_404_and_the_wrong_method_a_405(gateway):
    _, secret = create_key("k")
    assert error_of(client(secret).get(gateway.url + "/v1/chat/completions"))["code"] == "method_not_allowed"
    assert client(secret).post(gateway.url + "/v1/images/generations", json={}).status_code == 404


# --- streaming, usage and the time the gateway adds ------------------------------------------


def test_chunks_reach_the_client_while_the_replica_is_still_answering(gateway, replicas):
    add_model()
    replica = replicas()
    add_replica("chat", replica.base)
    _, secret = create_key("k")
    until_routed(client(secret), gateway.url)
    stream = held_stream(gateway.url, secret)
    lines = stream.iter_lines()
    first = next(line for line in lines if line)
    # The replica is holding the rest back: this chunk came through on its own.
    assert json.loads(first[len(b"data: ") :])["choices"][0]["delta"]["content"] == "c0"
    assert replica.open_streams == 1
    replica.release.set()
    rest = [line for line in lines if line]
    assert rest[-1] == b"data: [DONE]"
    assert stream.headers["content-type"] == "text/event-stream"


def test_usage_is_counted_per_key_and_model_streaming_included(gateway, replicas):
    add_model(aliases=["assistant"])
    replica = replicas()
    replica.usage = {"prompt_tokens": 11, "completion_tokens": 3}
    add_replica("chat", replica.base)
    _, secret = create_key("counted")
    session = client(secret)
    until_routed(session, gateway.url)
    assert chat(session, gateway.url).json()["usage"]["prompt_tokens"] == 11
    streamed = chat(session, gateway.url, model="assistant", stream=True)
    events = [line for line in streamed.text.splitlines() if line.startswith("data: {")]
    # The client did not ask for the usage chunk, so it does not get one; the gateway counted it anyway.
    assert all(json.loads(event[6:])["choices"] for event in events)
    assert replica.requests[-1]["stream_options"] == {"include_usage": True}
    asked = chat(session, gateway.url, stream=True, stream_options={"include_usage": True})
    assert '"usage"' in asked.text

    def counted():
        row = Usage.objects.filter(key__name="counted", model_name="chat").first()
        return row if row is not None and row.requests == 3 else None

    row = wait_until(counted, timeout=5, what="the usage to be written")
    assert (row.prompt_tokens, row.completion_tokens) == (33, 9)
    assert ApiKey.objects.get(name="counted").last_used is not None


def test_every_answer_says_how_long_the_gateway_itself_took(gateway, replicas):
    add_model()
    add_replica("chat", replicas().base)
    _, secret = create_key("k")
    session = client(secret)
    until_routed(session, gateway.url)
    for answer in (
        chat(session, gateway.url),
        chat(session, gateway.url, stream=True),
        chat(session, gateway.url, model="x"),
    ):
        name, _, duration = answer.headers["server-timing"].partition(";dur=")
        assert name == "gateway" and 0 < float(duration) < 1000


def open_descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_a_client_that_hangs_up_mid_stream_closes_the_replicas_connection_and_leaks_nothing(gateway, replicas):
    add_model()
    replica = replicas()
    add_replica("chat", replica.base)
    _, secret = create_key("k")
    until_routed(client(secret), gateway.url)
    chat(client(secret), gateway.url)  # the gateway's pool has its connection now
    pid = gateway.process.popen.pid
    before = open_descriptors(pid)
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + secret.encode() + b"\r\nContent-Length: %d\r\n\r\n%s"
    )
    body = json.dumps({"model": "chat", "messages": [], "stream": True, "hold": True}).encode()
    for round_ in range(10):
        with socket.create_connection(("127.0.0.1", int(gateway.url.rsplit(":", 1)[1])), timeout=10) as sock:
            sock.sendall(request % (len(body), body))
            assert b"c0" in sock.recv(65536) or b"c0" in sock.recv(65536)
            wait_until(lambda: replica.open_streams == 1, timeout=5, what="the stream to be open")
        hung_up = round_ + 1
        wait_until(lambda: replica.hung_up == hung_up, timeout=5, what="the replica to see the hang-up")  # noqa: B023
        wait_until(lambda: replica.open_streams == 0, timeout=5, what="the stream to close")
    # Sockets and tasks are gone: the process holds what it held before.
    wait_until(lambda: open_descriptors(pid) <= before, timeout=5, what=f"descriptors back to {before}")
    replica.release.set()
    time.sleep(0.2)  # a moment for the released replica; nothing says when it is done
    assert chat(client(secret), gateway.url).status_code == 200
