"""/healthz on each of llmgw's processes, each started as an operator starts it: 200 with what it checked,
503 with a sentence when something it needs is away (issue 41 item 13).

"Away" is a database address where nothing listens (or a node's cache gone from under
it): each process is started so, rather than stopping the session's PostgreSQL under
the other tests.
"""

from __future__ import annotations

import shutil

import pytest
import requests

from contracts.version import VERSION

from .services import free_port
from .support.gateway_process import start_gateway
from .support.processes import (
    start_admin_server,
    start_agent,
    start_byte_listener,
    unreachable_database_url,
    wait_until,
)

pytestmark = pytest.mark.django_db(transaction=True)


def logs(tmp_path, name: str):
    folder = tmp_path / name
    folder.mkdir(exist_ok=True)
    return folder


def health(url: str) -> tuple[int, dict]:
    answer = requests.get(url + "/healthz", timeout=10)
    assert answer.headers["Content-Type"].startswith("application/json"), answer.text
    return answer.status_code, answer.json()


def test_the_admin_server_says_it_is_healthy_and_503_with_a_sentence_when_its_database_is_away(tmp_path, processes):
    admin, url = start_admin_server(logs(tmp_path, "ok"))
    processes.append(admin)
    status, body = health(url)
    assert status == 200, body
    assert body["process"] == "admin server" and body["version"] == VERSION and body["status"] == "ok"
    assert body["checks"]["database"]["ok"] and body["checks"]["redis"]["ok"]

    alone, alone_url = start_admin_server(logs(tmp_path, "away"), DATABASE_URL=unreachable_database_url())
    processes.append(alone)
    status, body = health(alone_url)
    assert status == 503, body
    assert body["checks"]["database"]["ok"] is False and body["checks"]["redis"]["ok"]
    assert body["message"].startswith("The admin server is not healthy: its database is away")


def test_the_gateway_is_healthy_once_it_has_a_table_and_503_until_it_can_read_one(tmp_path, processes):
    gateway, url = start_gateway(logs(tmp_path, "ok"))
    processes.append(gateway)
    status, body = health(url)
    assert status == 200, body
    assert body["process"] == "gateway" and body["checks"]["table"]["ok"] and body["checks"]["database"]["ok"]

    alone, alone_url = start_gateway(logs(tmp_path, "away"), wait_status=503, DATABASE_URL=unreachable_database_url())
    processes.append(alone)
    status, body = health(alone_url)
    assert status == 503, body
    assert body["checks"]["table"] == {"ok": False, "needed": True, "error": "no table read from the database yet"}
    assert "cannot route a request" in body["message"]


def test_the_byte_listener_answers_its_health_to_anyone_and_503_when_its_database_is_away(tmp_path, processes):
    root = tmp_path / "mirror"
    root.mkdir()
    listener, url = start_byte_listener(root, logs(tmp_path, "ok"))
    processes.append(listener)
    status, body = health(url.rstrip("/"))  # no node's pass: a load balancer has none
    assert status == 200, body
    assert body["process"] == "byte listener" and body["checks"]["mirror"]["ok"]
    assert requests.get(url, timeout=10).status_code == 401  # the files themselves stay the fleet's

    alone, alone_url = start_byte_listener(root, logs(tmp_path, "away"), DATABASE_URL=unreachable_database_url())
    processes.append(alone)
    status, body = health(alone_url.rstrip("/"))
    assert status == 503, body
    assert "its database is away" in body["message"] and "cannot check a node's pass" in body["message"]


def test_a_nodes_agent_answers_its_health_on_its_metrics_port_and_503_once_its_cache_is_gone(
    enrolled_node, agent_cache, tmp_path, processes
):
    name, token = enrolled_node
    port = free_port()
    agent = start_agent(
        name, token, agent_cache, tmp_path, LLMGW_AGENT_METRICS_ADDR=f"127.0.0.1:{port}", LLMGW_AGENT_METRICS_TOKEN="t"
    )
    processes.append(agent)
    url = f"http://127.0.0.1:{port}"
    status, body = health(url)  # without the scrape token
    assert status == 200, body
    assert body["process"] == "agent" and body["checks"]["broker"]["ok"] and body["checks"]["cache"]["ok"]

    shutil.rmtree(agent_cache)  # the disk the weights were on, unmounted under it
    wait_until(lambda: health(url)[0] == 503, what="the agent to say its cache is away")
    status, body = health(url)
    assert body["checks"]["cache"]["ok"] is False and "cannot keep weights" in body["message"]
