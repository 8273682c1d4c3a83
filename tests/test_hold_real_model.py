"""Holding and broken streams on the real engine: SmolLM2 on this host's llama.cpp, and the real agent.

A request for a model whose replica is still on its way waits, with comments, and is
answered by the replica the agent fetches and starts; a stream whose engine is killed
(SIGKILL) mid-answer ends with an error event in its own format and a whole chunked
response, and the official clients raise a clean error for it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading

import pytest
import requests

from agent import engines
from catalog.models import Model, Profile
from contracts import demand
from fleet.models import Node, Replica
from gateway.keys import create_key
from mirror import scan

from . import real_model
from .real_model import MODEL, ask, streamed_whole
from .support.gateway import until_routed
from .support.mirror import settle
from .support.processes import wait_until
from .support.sdk import anthropic, openai

pytestmark = [pytest.mark.engine, pytest.mark.django_db(transaction=True)]


def test_a_streamed_request_for_a_model_at_zero_wakes_it_and_waits_while_its_replica_is_fetched_and_started(
    settings, mirror_root, byte_listener, control_worker, agent_n1, gateway
):
    weights = real_model.gguf()
    settings.BYTES_URL = byte_listener
    version = mirror_root / MODEL / "instruct-q4_1"
    version.mkdir(parents=True)
    shutil.copyfile(weights, version / weights.name)
    settle(version)  # copied in a while ago: whole, not still being written (LLMGW_MIRROR_SETTLE_S)
    scan.scan_mirror()
    wait_until(
        lambda: "llamacpp" in (Node.objects.filter(name="n1").values_list("engines", flat=True).first() or []),
        timeout=120,
        interval=0.5,
        what=f"n1's heartbeat\n{agent_n1[0].output()[-3000:]}",
    )
    source = f"{byte_listener}{MODEL}/instruct-q4_1/{weights.name}"
    model = Model.objects.create(name=MODEL, source=source, context_length=2048, scaling_min=0, scaling_max=1)
    Profile.objects.create(model=model, name="cpu", engine="llamacpp", args=["--ctx-size", "2048"])
    _, secret = create_key("k")
    lines: list[str] = []
    box = {}

    def client():
        body = {"model": MODEL, **ask(), "stream": True, "stream_options": {"include_usage": True}}
        with requests.post(
            gateway.url + "/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {secret}"},
            stream=True,
            timeout=300,
        ) as response:
            box["status"] = response.status_code
            for line in response.iter_lines(decode_unicode=True):
                lines.append(line)

    # The agent is held (SIGSTOP) until the request has said that it waits: on a quiet machine the
    # whole wake (placed, fetched, started) took less than the gateway's first comment (FIRST_COMMENT_S),
    # and the request was answered without one, CI 2026-12-05.
    os.killpg(agent_n1[0].popen.pid, signal.SIGSTOP)
    try:
        thread = threading.Thread(target=client, daemon=True)
        thread.start()
        wait_until(
            lambda: any(line.startswith(": waiting") for line in lines),
            timeout=10,
            what=lambda: f"a waiting comment; status {box.get('status')}, lines {lines[:10]}",
        )
    finally:
        os.killpg(agent_n1[0].popen.pid, signal.SIGCONT)
    # The request asked for the wake (fleet.wake, on the control worker): the autoscaler places a
    # replica, the agent fetches the weights and starts the engine, and the request goes to it.
    thread.join(300)
    assert not thread.is_alive(), f"no answer; replicas: {list(Replica.objects.values('state', 'reason'))}"
    assert box["status"] == 200
    comments = [line for line in lines if line.startswith(":")]
    assert comments[0] == f": waiting for a replica of {MODEL}: scaled to zero, waking", comments
    text, usage, finish = streamed_whole([line[len("data: ") :] for line in lines if line.startswith("data: ")])
    assert real_model.ANSWER in text and usage["completion_tokens"] > 0, text
    assert Replica.objects.filter(model_name=MODEL, state="ready").count() == 1


def test_requests_waiting_for_a_model_are_answered_by_the_real_engine_in_the_order_they_came(
    tmp_path, gateway, redis_client
):
    """Held requests are sent on to the real engine in the order they came, and each is answered."""
    process, engine_endpoint, _ = real_model.start_engine(real_model.gguf(), tmp_path)
    # The order the gateway sends them on is what it controls: seen by a recorder in front of the engine.
    # (The order its answers reach the client's threads is the engine's: llama-server takes connections
    # with a small HTTP thread pool, so under load it read them two places apart, CI 2026-12-04.)
    recorder = OrderRecorder(engine_endpoint)
    endpoint = recorder.url
    try:
        model = Model.objects.create(name=MODEL, source="http://127.0.0.1:1/smollm2/", context_length=2048)
        Model.objects.filter(pk=model.pk).update(scaling_min=0, scaling_max=1)
        Profile.objects.create(model=model, name="cpu", engine="llamacpp")
        _, secret = create_key("k")
        finished: list[int] = []
        statuses: dict[int, int] = {}

        def one(n: int) -> None:
            body = {"model": MODEL, **ask(f"Say the number {n}.", max_tokens=12)}
            answer = requests.post(
                gateway.url + "/v1/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {secret}"},
                timeout=120,
            )
            statuses[n] = answer.status_code
            finished.append(n)

        threads = []
        for n in range(6):
            threads.append(threading.Thread(target=one, args=(n,), daemon=True))
            threads[-1].start()
            wait_until(lambda n=n: waiting(redis_client) == n + 1, timeout=10, what=f"request {n} to wait")
        Replica.objects.create(
            model_name=MODEL, profile_name="cpu", node=Node.objects.create(name="n1"), state="ready", endpoint=endpoint
        )
        for thread in threads:
            thread.join(120)
        assert statuses == dict.fromkeys(range(6), 200) and sorted(finished) == list(range(6))
        # Sent on in the order they came. They are let go 10 ms apart; under heavy load two neighbours
        # may reach the recorder's threads the other way round, so a swap of neighbours is allowed;
        # anything further out of order (all let go at once, say) fails.
        sent = recorder.numbers
        assert sorted(sent) == list(range(6)), sent
        assert sent[0] == 0 and all(abs(at - n) <= 1 for at, n in enumerate(sent)), sent
    finally:
        recorder.stop()
        engines.stop_group(process.pid, grace=3)
        process.wait(timeout=10)


class OrderRecorder:
    """A loopback HTTP relay in front of an engine that notes the number each chat request asks to say, as it arrives."""

    def __init__(self, endpoint: str):
        import http.client
        import http.server
        import re
        from urllib.parse import urlsplit

        upstream = urlsplit(endpoint)
        recorder = self
        self.numbers: list[int] = []
        self._lock = threading.Lock()

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _relay(self, method: str) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if method == "POST" and (said := re.search(rb"Say the number (\d+)", body)):
                    with recorder._lock:
                        recorder.numbers.append(int(said.group(1)))
                conn = http.client.HTTPConnection(upstream.hostname, upstream.port, timeout=120)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                    conn.request(method, self.path, body=body or None, headers=headers)
                    answer = conn.getresponse()
                    data = answer.read()
                    self.send_response(answer.status)
                    for name, value in answer.getheaders():
                        if name.lower() not in ("connection", "transfer-encoding", "content-length", "keep-alive"):
                            self.send_header(name, value)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                finally:
                    conn.close()

            def do_GET(self):
                self._relay("GET")

            def do_POST(self):
                self._relay("POST")

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}{upstream.path}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def waiting(redis_client) -> int:
    snapshots = [demand.decode(raw) for raw in redis_client.hgetall(demand.LOAD_KEY).values()]
    return sum(s["models"].get(MODEL, {}).get("waiting", 0) for s in snapshots if s)


# --- an engine killed mid-stream -----------------------------------------------------------


@pytest.fixture
def killable(tmp_path, gateway):
    """A fresh real engine, the one ready replica of the model: (gateway url, key, the engine's process)."""
    process, endpoint, _ = real_model.start_engine(real_model.gguf(), tmp_path)
    model = Model.objects.create(name=MODEL, source="http://127.0.0.1:1/smollm2/", context_length=2048)
    Profile.objects.create(model=model, name="cpu", engine="llamacpp")
    node = Node.objects.create(name="n1")
    Replica.objects.create(model_name=MODEL, profile_name="cpu", node=node, state="ready", endpoint=endpoint)
    _, secret = create_key("k")
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {secret}"
    until_routed(session, gateway.url, MODEL)
    yield gateway.url, secret, process
    if engines.group_alive(process.pid):
        engines.stop_group(process.pid, grace=3)
    process.wait(timeout=10)


LONG = "Count from 1 to 500, one number a line."


def kill(process) -> None:
    os.killpg(process.pid, signal.SIGKILL)


BODIES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": LONG}], "max_tokens": 400},
    "/v1/messages": {"messages": [{"role": "user", "content": LONG}], "max_tokens": 400},
    "/v1/responses": {"input": LONG, "max_output_tokens": 400},
}


@pytest.mark.parametrize(
    "path, error_line",
    [("/v1/chat/completions", "data: [DONE]"), ("/v1/messages", "event: error"), ("/v1/responses", "event: error")],
)
def test_an_engine_killed_mid_stream_ends_the_stream_with_an_error_event_and_a_whole_response(
    killable, path, error_line
):
    url, secret, process = killable
    body = {"model": MODEL, **BODIES[path], "stream": True, "temperature": 0}
    lines = []
    with requests.post(
        url + path, json=body, headers={"Authorization": f"Bearer {secret}"}, stream=True, timeout=120
    ) as response:
        assert response.status_code == 200
        # iter_lines raises ChunkedEncodingError on a connection cut before the last chunk.
        for line in response.iter_lines(decode_unicode=True):
            lines.append(line)
            if sum(1 for seen in lines if seen.startswith("data: ")) == 8:
                kill(process)
    assert error_line in lines, lines[-6:]
    errors = [json.loads(line[6:]) for line in lines if line.startswith("data: {") and '"error"' in line]
    assert errors, lines[-6:]
    said = json.dumps(errors[-1])
    assert "stopped in the middle of this answer" in said, said
    if path == "/v1/chat/completions":
        # The error event, then [DONE]: the end of an OpenAI stream.
        assert [line for line in lines if line][-2:] == [lines[lines.index("data: [DONE]") - 2], "data: [DONE]"]
        assert '"error"' in [line for line in lines if line][-2]


def test_the_official_clients_raise_a_clean_api_error_when_the_engine_dies_mid_stream(killable):
    url, secret, process = killable
    gpt = openai.OpenAI(base_url=url + "/v1", api_key=secret, max_retries=0, timeout=120)
    stream = gpt.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": LONG}], max_tokens=400, stream=True, temperature=0
    )
    chunks = 0
    with pytest.raises(openai.APIError) as raised:
        for _ in stream:
            chunks += 1
            if chunks == 8:
                kill(process)
    # An error the server said, not a transport failure.
    assert not isinstance(raised.value, openai.APIConnectionError)
    assert "stopped in the middle of this answer" in raised.value.message


def test_the_anthropic_client_raises_a_clean_api_error_when_the_engine_dies_mid_stream(killable):
    url, secret, process = killable
    claude = anthropic.Anthropic(base_url=url, api_key=secret, max_retries=0, timeout=120)
    events = 0
    with pytest.raises(anthropic.APIStatusError) as raised:
        with claude.messages.stream(
            model=MODEL, messages=[{"role": "user", "content": LONG}], max_tokens=400
        ) as stream:
            for _ in stream:
                events += 1
                if events == 8:
                    kill(process)
    assert "stopped in the middle of this answer" in str(raised.value)
