"""Issue 13, item 1a: whoever reaches Redis can put a task on a node's queue; the node runs
only what the control plane signed for it.

Real: Redis, the `manage.py agent` worker for n1 (no database), the byte listener, and
(for the stop) llama.cpp on a tiny model. The forged messages are put on the queue with
a Celery app's `send_task`, the real message format, as an attacker with the broker's
address would.
"""

from __future__ import annotations

import http.server
import threading
import time

import pytest
import requests
from celery import current_app

from agent import engine_state, engines
from contracts import keys, signing
from contracts import progress as contracts_progress
from fleet import reconcile
from fleet.enrolment import issue_token
from fleet.models import Node, Replica
from launcher.demo_model import write_tiny_llama

from .services import free_port
from .support.mirror import put
from .support.processes import engine_secret, start_agent
from .support.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


class RecordingServer:
    """A loopback HTTP server that answers 404 to everything and remembers each request."""

    def __init__(self):
        self.requests: list[str] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                server.requests.append(self.path)
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_HEAD = do_GET

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(autouse=True)
def empty_queue(redis_client):
    redis_client.delete("unacked", "unacked_index", *keys.unacked_keys("n1").values(), "node.n1")


@pytest.fixture
def elsewhere():
    server = RecordingServer()
    yield server
    server.stop()


@pytest.fixture
def enrolled_agent(enrolled_node, byte_listener, agent_cache, tmp_path):
    name, token = enrolled_node
    agent = start_agent(name, token, agent_cache, tmp_path, LLMGW_BYTES_URL=byte_listener)
    yield agent
    agent.stop()
    for entry in engine_state.read_state(agent_cache)["replicas"].values():
        if entry.get("pid") and engines.group_alive(entry["pid"]):
            engines.stop_group(entry["pid"], grace=3)


def forge(task: str, args: list, kwargs: dict | None = None, node: str = "n1") -> None:
    current_app.send_task(task, args=args, kwargs=kwargs or {}, queue=f"node.{node}")


def dropped(agent, task: str, count: int) -> bool:
    return agent.output().count(f"dropped {task}") >= count


def test_a_forged_start_is_dropped_and_logged_and_fetches_nothing_and_starts_nothing(
    enrolled_agent, agent_cache, elsewhere, redis_client
):
    issue_token("n2")
    n2_key = Node.objects.get(name="n2").token_hash
    source = elsewhere.url + "evil/v1/"
    args = [4242, source, "llamacpp", ["--ctx-size", "64"]]
    # No proof at all, as the issue's attacker sent it.
    forge("agent.start_replica", args, {"model": "evil"})
    # A proof made with another node's key, for that node.
    forge("agent.start_replica", args, signing.with_proof(n2_key, "agent.start_replica", "n2", args, {"model": "evil"}))
    # Another node's key, claiming to be for n1.
    forge("agent.start_replica", args, signing.with_proof(n2_key, "agent.start_replica", "n1", args, {"model": "evil"}))
    # A real proof of n1, copied onto other arguments.
    n1_key = Node.objects.get(name="n1").token_hash
    genuine = signing.with_proof(n1_key, "agent.start_replica", "n1", [4242, source, "llamacpp", []], {"model": "x"})
    forge("agent.start_replica", args, {**genuine, "model": "x"})
    # A proof that has expired.
    stale = signing.sign(n1_key, "agent.start_replica", "n1", args, {"model": "evil"}, now=time.time() - 7200)
    forge("agent.start_replica", args, {"model": "evil", "proof": stale})

    wait_until(
        lambda: dropped(enrolled_agent, "agent.start_replica", 5), timeout=30, what=enrolled_agent.output()[-2000:]
    )
    output = enrolled_agent.output()
    assert "carries no proof that the control plane sent it" in output
    assert "its proof does not match" in output
    assert "its proof expired" in output
    time.sleep(1)  # proving an absence: the dropped tasks fetch nothing from elsewhere a second on
    assert elsewhere.requests == []
    assert engine_state.read_state(agent_cache)["replicas"] == {}
    assert redis_client.hget(contracts_progress.progress_key("n1"), source) is None
    assert enrolled_agent.alive()


def test_a_forged_fetch_is_dropped_and_the_control_planes_own_is_fetched(
    enrolled_agent, byte_listener, mirror_root, agent_cache, elsewhere
):
    put(mirror_root, "m", "v1", {"a.bin": b"a" * 1000})
    forge("agent.fetch", [byte_listener + "m/v1/"])
    wait_until(lambda: dropped(enrolled_agent, "agent.fetch", 1), timeout=30, what="the forged fetch to be dropped")
    assert not (agent_cache / "127.0.0.1_{}".format(byte_listener.rsplit(":", 1)[1].strip("/"))).exists()

    from fleet.models import Fetch

    Fetch.objects.request(Node.objects.get(name="n1"), byte_listener + "m/v1/")
    port = byte_listener.rsplit(":", 1)[1].strip("/")
    marker = agent_cache / f"127.0.0.1_{port}" / "m" / "v1" / ".complete"
    wait_until(marker.exists, timeout=60, what=f"the control plane's fetch\n{enrolled_agent.output()[-2000:]}")


@pytest.mark.engine
def test_a_forged_stop_does_not_stop_a_running_replica_and_the_control_planes_does(
    enrolled_agent, byte_listener, mirror_root, agent_cache, tmp_path
):
    write_tiny_llama(tmp_path / "gguf")
    put(mirror_root, "tiny", "v1", {p.name: p.read_bytes() for p in (tmp_path / "gguf").glob("*.gguf")})
    node = Node.objects.get(name="n1")
    replica = Replica.objects.create(
        model_name="tiny",
        profile_name="cpu",
        node=node,
        source=byte_listener + "tiny/v1/",
        engine="llamacpp",
        args=["--ctx-size", "256"],
    )
    reconcile.send_start(replica)

    def ready():
        entry = engine_state.read_state(agent_cache)["replicas"].get(str(replica.pk)) or {}
        return entry if entry.get("ready") else None

    entry = wait_until(
        ready, timeout=180, interval=0.5, what=f"the engine to be ready\n{enrolled_agent.output()[-3000:]}"
    )
    endpoint = f"http://127.0.0.1:{entry['port']}/v1/models"

    forge("agent.stop_replica", [replica.pk])
    other_key = signing.token_hash("llmgw-node-somebody-else")
    forge("agent.stop_replica", [replica.pk], signing.with_proof(other_key, "agent.stop_replica", "n1", [replica.pk]))
    wait_until(
        lambda: dropped(enrolled_agent, "agent.stop_replica", 2), timeout=30, what="the forged stops to be dropped"
    )
    time.sleep(2)  # proving an absence: the forged stops are not obeyed two seconds on
    entry = engine_state.read_state(agent_cache)["replicas"][str(replica.pk)]
    assert entry["wanted"] and engines.group_alive(entry["pid"])
    assert (
        requests.get(endpoint, headers=engine_secret(Replica.objects.get(pk=replica.pk)), timeout=10).status_code == 200
    )

    reconcile.send_stop(replica.pk, "n1")
    wait_until(
        lambda: str(replica.pk) not in engine_state.read_state(agent_cache)["replicas"],
        timeout=60,
        what="the control plane's stop to stop the engine",
    )
    assert not engines.group_alive(entry["pid"])
