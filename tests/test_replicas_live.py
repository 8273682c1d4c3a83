"""End to end, every part real: a GGUF put in the mirror, served through the API,
fetched by an agent, run by llama.cpp as two replicas, answering through the /v1/
gateway, the second taking over when the first's engine is killed, and the first
back by itself.

Real: the byte listener, Redis, the control worker (reconcile and reports), the
`manage.py agent` worker for node n1 with its heartbeat and engine supervisor, and
llama.cpp built from source by llama-cpp-python on a tiny model the test writes.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
import requests

from agent import engine_state, engines
from agent.fetch import cache_path
from catalog.models import Model
from fleet.models import Replica
from launcher.demo_model import EOS_TOKEN_ID

from .support.processes import ask_replica, engine_secret
from .support.serving import mirror_tiny, serve_tiny, wait_enrolled
from .support.waiting import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.engine]


def test_a_served_gguf_is_fetched_started_answers_and_comes_back_after_its_engine_is_killed(
    settings, tmp_path, mirror_root, byte_listener, control_worker, agent_n1, live_server, gateway
):
    agent, cache = agent_n1
    settings.BYTES_URL = byte_listener
    mirror_tiny(mirror_root, tmp_path)
    wait_enrolled(agent, "n1")
    plan = serve_tiny(live_server, replicas=2)
    assert plan["source"] == byte_listener + "tiny/v1/" and plan["engine"] == "llamacpp" and plan["files"] == 3
    assert Model.objects.get(name="tiny").added_by == "robot"

    def both_ready():
        replicas = list(Replica.objects.filter(model_name="tiny", state="ready"))
        return replicas if len(replicas) == 2 else None

    replica, other = wait_until(
        both_ready,
        timeout=240,
        interval=0.5,
        what=f"two ready replicas: {list(Replica.objects.values('state', 'reason'))}\n{agent.output()[-3000:]}",
    )
    assert replica.node.name == other.node.name == "n1"
    ask_replica(replica)

    # The replica's fetch is on the record like any other, which placement reads too.
    from fleet.models import Fetch

    fetched = wait_until(
        lambda: Fetch.objects.filter(node__name="n1", source=plan["source"], state="complete").first(),
        timeout=30,
        what="the replica's fetch to be reported",
    )
    assert fetched.files_total == 3

    weights = cache_path(plan["source"], cache)
    assert sorted(p.name for p in weights.iterdir()) == [
        ".complete",
        "tiny-00001-of-00003.gguf",
        "tiny-00002-of-00003.gguf",
        "tiny-00003-of-00003.gguf",
    ]

    # --- through the gateway, as a client sees it ---
    from gateway.keys import create_key
    from gateway.models import Usage

    _, secret = create_key("e2e")
    client = requests.Session()
    client.headers["Authorization"] = f"Bearer {secret}"
    ask = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8,
        "logit_bias": {str(EOS_TOKEN_ID): -100},
    }
    wait_until(
        lambda: all(m["ready"] for m in client.get(gateway.url + "/v1/models").json()["data"]),
        timeout=10,
        what="the gateway to route tiny",
    )
    whole = client.post(gateway.url + "/v1/chat/completions", json=ask, timeout=60)
    assert whole.status_code == 200, whole.text
    assert whole.json()["choices"][0]["finish_reason"] == "length"
    prompt_tokens, completion_tokens = (whole.json()["usage"][k] for k in ("prompt_tokens", "completion_tokens"))
    assert prompt_tokens > 0 and completion_tokens >= 8

    def counted(requests_made: int):
        def check():
            row = Usage.objects.filter(key__name="e2e", model_name="tiny").first()
            return row if row is not None and row.requests == requests_made else None

        return check

    usage = wait_until(counted(1), timeout=10, what="the usage to be written")
    assert (usage.prompt_tokens, usage.completion_tokens) == (prompt_tokens, completion_tokens)

    streamed = client.post(gateway.url + "/v1/chat/completions", json=dict(ask, stream=True), stream=True, timeout=60)
    assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
    events = [line[len(b"data: ") :] for line in streamed.iter_lines() if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"

    # The streamed answer is counted too, from the usage the engine put in its last chunk.
    usage = wait_until(counted(2), timeout=10, what="the streamed usage to be written")
    assert usage.prompt_tokens == 2 * prompt_tokens
    assert usage.completion_tokens >= completion_tokens + 8

    too_long = client.post(
        gateway.url + "/v1/chat/completions", json=dict(ask, messages=[{"role": "user", "content": "x" * 400}])
    )
    assert too_long.status_code == 400 and "context" in too_long.json()["error"]["message"]

    # The replica that answered last loses its engine; the other takes over at once.
    served_by = int(streamed.headers["x-llmgw-replica"])
    replica, other = (replica, other) if replica.pk == served_by else (other, replica)
    pid = engine_state.read_state(cache)["replicas"][str(replica.pk)]["pid"]
    os.killpg(pid, signal.SIGKILL)
    for _ in range(4):
        answer = client.post(gateway.url + "/v1/chat/completions", json=ask, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-llmgw-replica"] == str(other.pk)
    first_endpoint = replica.endpoint

    def back():
        replica.refresh_from_db()
        return replica.state == "ready" and replica.endpoint != first_endpoint

    wait_until(back, timeout=240, interval=0.5, what="the replica to come back by itself")
    assert requests.get(replica.endpoint + "/models", headers=engine_secret(replica), timeout=10).status_code == 200
    assert not engines.group_alive(pid)
