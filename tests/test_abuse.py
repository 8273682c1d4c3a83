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

from agent import engine_state, engines, supervisor
from gateway.intake import LONGEST_TOKEN_CHARS
from gateway.keys import create_key
from gateway.models import Usage

from .support.engines import Reports, step_until
from .support.factories import add_model, add_replica
from .support.gateway import client, error_of, until_routed
from .support.processes import as_node, node_pass, start_byte_listener
from .support.waiting import wait_until

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
    # The prompt, estimated from the size of the body the engine was sent, at four bytes a token.
    sent = json.dumps(fake.requests[-1])
    assert row.prompt_tokens == -(-len(sent) // 4) > 105


# --- 7. slow clients against the byte listener --------------------------------------


class Slowloris:
    """Connections that each send a request's first line and then one header line every few seconds."""

    def __init__(self, url: str, count: int, every: float) -> None:
        host, port = url.split("//")[1].rstrip("/").split(":")
        self.sockets = []
        for _ in range(count):
            sock = socket.create_connection((host, int(port)), timeout=5)
            sock.settimeout(None)  # so that a peek with MSG_DONTWAIT says at once whether it is open
            sock.sendall(b"GET / HTTP/1.1\r\nHost: mirror\r\n")
            self.sockets.append(sock)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._drip, args=(every,), daemon=True)
        self.thread.start()

    def _drip(self, every: float) -> None:
        while not self.stopping.wait(every):
            for sock in self.sockets:
                try:
                    sock.sendall(b"X-Slow: 1\r\n")
                except OSError:
                    pass  # closed by the server: what the timeout is for

    def open(self) -> int:
        return still_open(self.sockets)

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(10)
        for sock in self.sockets:
            sock.close()


def still_open(sockets: list[socket.socket]) -> int:
    """How many of these connections the server has not closed (nor answered)."""
    count = 0
    for sock in sockets:
        try:
            sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            count += 1  # nothing to read and not closed
        except OSError:
            pass
    return count


@pytest.fixture
def slow_clients():
    made = []

    def make(url: str, count: int, every: float) -> Slowloris:
        made.append(Slowloris(url, count, every))
        return made[-1]

    yield make
    for slow in made:
        slow.close()


def test_a_thousand_slow_clients_do_not_stop_a_download_from_starting_within_a_second(
    tmp_path, mirror_root, fleet_node, slow_clients
):
    weights = bytes(range(256)) * 16384  # 4 MiB
    (mirror_root / "m" / "v1").mkdir(parents=True)
    (mirror_root / "m" / "v1" / "weights.bin").write_bytes(weights)
    # Heads may take a minute here, so the slow clients are all still open during the download.
    process, url = start_byte_listener(mirror_root, tmp_path, LLMGW_BYTES_HEADER_TIMEOUT_S=60)
    try:
        slow = slow_clients(url, 1000, every=3)
        # A fixed pause: the listener tells nobody what it has accepted; a second to take all 1000 in.
        time.sleep(1)
        assert slow.open() == 1000

        started = time.monotonic()
        download = as_node.get(url + "m/v1/weights.bin", stream=True, timeout=10)
        first_byte = time.monotonic() - started
        body = download.content
        took = time.monotonic() - started
        assert download.status_code == 200 and body == weights
        assert first_byte < 1.0, f"the download began {first_byte:.2f} s after it was asked for"
        assert took < 2.0, f"the download took {took:.2f} s"
        assert slow.open() == 1000, "the slow clients were let go before the download: the test proves nothing"
        assert process.alive()
    finally:
        process.stop()


def test_slow_and_idle_connections_to_the_byte_listener_are_closed_after_the_header_timeout(
    tmp_path, mirror_root, fleet_node, slow_clients
):
    process, url = start_byte_listener(mirror_root, tmp_path, LLMGW_BYTES_HEADER_TIMEOUT_S=2)
    idle: list[socket.socket] = []
    try:
        slow = slow_clients(url, 20, every=0.5)
        host, port = url.split("//")[1].rstrip("/").split(":")
        idle += [socket.create_connection((host, int(port))) for _ in range(20)]  # they send nothing at all
        time.sleep(0.5)  # proving an absence: none of them is closed half a second on
        assert slow.open() == 20 and still_open(idle) == 20

        def all_closed():
            return slow.open() == 0 and still_open(idle) == 0

        wait_until(all_closed, timeout=8, what="the slow and idle connections to be closed")
        # And the listener still answers.
        assert as_node.get(url, timeout=5).status_code == 200
    finally:
        for sock in idle:
            sock.close()
        process.stop()


# --- 2. an engine busy with a long prompt is not a dead one -------------------------


@pytest.mark.engine
def test_an_engine_busy_reading_a_long_prompt_is_not_killed_by_its_liveness_check(
    tmp_path,
    tiny_gguf,  # noqa: F811
    engine_cleanup,  # noqa: F811
):
    cache = tmp_path / "cache"
    reports = Reports()
    # Checked every second, half a second to answer, three in a row: killed after about 4.5 s of silence.
    sup = supervisor.Supervisor(cache, reports, liveness_interval=1, liveness_timeout=0.5, liveness_failures=3)
    engine_state.want(cache, 1, "llamacpp", "http://mirror/tiny/v1/", tiny_gguf, ["--ctx-size", "256"], "tiny")
    step_until(sup, lambda: "ready" in reports.states(), 120, "llama.cpp to answer on /v1/models")
    endpoint = reports.last()[2]
    pid = engine_state.read_state(cache)["replicas"]["1"]["pid"]

    # What the attack sent: a prompt the engine reads for many seconds, answering nothing meanwhile.
    outcome: dict = {}

    def long_prompt() -> None:
        started = time.monotonic()
        try:
            answer = requests.post(
                endpoint + "/chat/completions",
                json={"messages": [{"role": "user", "content": "x" * 600_000}], "max_tokens": 8},
                timeout=300,
            )
            outcome["status"] = answer.status_code
        except requests.RequestException as error:
            outcome["error"] = error
        outcome["took"] = time.monotonic() - started

    sender = threading.Thread(target=long_prompt)
    sender.start()
    while sender.is_alive():
        sup.step()
        time.sleep(0.2)  # the supervisor's pace while the long prompt is read, as an agent steps it

    assert "error" not in outcome, f"the engine went away mid-request: {outcome['error']}"
    assert outcome["took"] > 6, "the engine was not busy past the liveness window: the test proves nothing"
    # Never reported starting again or failed (a ready said twice is still the same engine), and the same process.
    states = reports.states()
    assert states[:2] == ["starting", "ready"] and set(states[1:]) == {"ready"}, states
    assert engine_state.read_state(cache)["replicas"]["1"]["pid"] == pid
    # The engine's own refusal, once it has read the prompt; and it answers again.
    assert outcome["status"] == 400
    assert engines.answers(engine_state.read_state(cache)["replicas"]["1"]["port"], timeout=5)


def test_clients_that_stop_reading_mid_download_do_not_hold_up_the_next_download(tmp_path, mirror_root, fleet_node):
    """A body goes out in a thread while the client reads; one that stops reading gives the thread back."""
    (mirror_root / "m" / "v1").mkdir(parents=True)
    (mirror_root / "m" / "v1" / "large.bin").write_bytes(b"\0" * (32 << 20))
    weights = bytes(range(256)) * 16384  # 4 MiB
    (mirror_root / "m" / "v1" / "weights.bin").write_bytes(weights)
    process, url = start_byte_listener(mirror_root, tmp_path)
    host, port = url.split("//")[1].rstrip("/").split(":")
    stalled = []
    # Nodes (with a pass) that stop reading: a stranger's request is refused before any file is opened.
    authorization = node_pass()(requests.Request("GET", url).prepare()).headers["Authorization"]
    try:
        for _ in range(100):
            sock = socket.create_connection((host, int(port)))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.sendall(
                f"GET /m/v1/large.bin HTTP/1.1\r\nHost: mirror\r\nAuthorization: {authorization}\r\n\r\n".encode()
            )
            stalled.append(sock)  # and never read from
        time.sleep(2)  # a fixed pause: their buffers fill, which nothing outside the listener can see
        started = time.monotonic()
        download = as_node.get(url + "m/v1/weights.bin", stream=True, timeout=10)
        first_byte = time.monotonic() - started
        assert download.status_code == 200 and download.content == weights
        assert first_byte < 1.0, f"the download began {first_byte:.2f} s after it was asked for"
        assert time.monotonic() - started < 2.0
    finally:
        for sock in stalled:
            sock.close()
        process.stop()
