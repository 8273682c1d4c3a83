"""A replica from placement to tokens, through real processes, and back after its engine is killed.

Real: the byte listener serving a 3-file GGUF from the mirror, Redis, a control
worker recording reports in the database, a node worker on `node.n1` running
`agent.start_replica`, the node's supervisor process, and llama.cpp. The catalog
is given to the reconcile pass as a snapshot (the catalog app is another branch),
and the node worker uses tests/agent_stand_ins.py for the agent issue's runtime and
fetch until that branch is merged. Still to add at merge: `POST /api/serve/` in
place of the snapshot, and the real agent command in place of the stand-ins.
"""

from __future__ import annotations

import os
import signal
import sys

import pytest
import requests
from django.utils import timezone

from agent import engines, supervisor
from fleet import reconcile
from fleet.enrolment import issue_token
from fleet.models import Node, Replica
from fleet.placement import ModelView, ProfileView

from .conftest import put
from .gguf_model import EOS_TOKEN_ID, write_tiny_llama
from .processes import Process, process_env, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.engine]


@pytest.fixture
def node_n1(tmp_path, mirror_root):
    token = issue_token("n1")
    Node.objects.filter(name="n1").update(engines=["llamacpp"], memory_gb=16, last_heartbeat=timezone.now())
    cache = tmp_path / "cache-n1"
    env = process_env(LLMGW_NODE="n1", LLMGW_AGENT_CACHE=cache, LLMGW_NODE_TOKEN=token, LLMGW_MIRROR_ROOT=mirror_root)
    worker = Process(
        "node-n1",
        [
            sys.executable,
            "-m",
            "tests.agent_stand_ins",
            "worker",
            "-Q",
            "node.n1",
            "-n",
            "n1@%h",
            "--concurrency",
            "1",
            "--without-gossip",
            "--without-mingle",
            "--loglevel",
            "INFO",
        ],
        env,
        tmp_path,
    )
    wait_until(lambda: "ready." in worker.output() or not worker.alive(), timeout=30, what="the node worker")
    assert worker.alive(), worker.output()
    sup = Process("supervisor-n1", [sys.executable, "-m", "agent.supervisor", "--cache", str(cache)], env, tmp_path)
    yield cache
    sup.stop()
    worker.stop()
    for entry in supervisor.read_state(cache)["replicas"].values():
        if entry.get("pid"):
            engines.stop_group(entry["pid"], grace=3)


def test_a_placed_replica_is_fetched_started_reported_ready_and_comes_back_after_a_kill(
    tmp_path, mirror_root, byte_listener, control_worker, node_n1
):
    write_tiny_llama(tmp_path / "gguf")
    put(mirror_root, "tiny", "v1", {p.name: p.read_bytes() for p in (tmp_path / "gguf").glob("*.gguf")})
    model = ModelView(
        "tiny", byte_listener + "tiny/v1/", 1, (ProfileView("cpu", "llamacpp", ("--n_ctx", "256"), min_memory_gb=2),)
    )

    reconcile.reconcile(models=[model])
    replica = Replica.objects.get()
    assert replica.node.name == "n1"

    def state_is(state: str):
        def check():
            replica.refresh_from_db()
            return replica.state == state

        return check

    wait_until(state_is("ready"), timeout=180, interval=0.5, what=f"the replica to be ready ({replica.reason})")
    first_endpoint = replica.endpoint
    answer = requests.post(
        first_endpoint + "/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 8,
            "logit_bias": {str(EOS_TOKEN_ID): -100},
        },
        timeout=60,
    ).json()
    # Generated up to the limit: tokens, not an empty answer. (The usage count may
    # differ from 8, since llama-cpp-python counts the decoded text's tokens again.)
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] > 0
    from agent.fetch import cache_path

    weights = cache_path(byte_listener + "tiny/v1/", node_n1)
    assert sorted(p.name for p in weights.iterdir()) == [
        ".complete",
        "tiny-00001-of-00003.gguf",
        "tiny-00002-of-00003.gguf",
        "tiny-00003-of-00003.gguf",
    ]

    pid = supervisor.read_state(node_n1)["replicas"][str(replica.pk)]["pid"]
    os.killpg(pid, signal.SIGKILL)

    def back():
        replica.refresh_from_db()
        return replica.state == "ready" and replica.endpoint != first_endpoint

    wait_until(back, timeout=180, interval=0.5, what="the replica to come back by itself")
    assert replica.attempts == 0
    assert requests.get(replica.endpoint + "/models", timeout=10).status_code == 200
    assert not engines.group_alive(pid)
