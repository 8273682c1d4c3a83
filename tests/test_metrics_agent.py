"""The node's own /metrics: served by `manage.py agent`, behind its token, with each engine's metrics under its labels."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading

import pytest
import requests
from prometheus_client import CollectorRegistry, generate_latest

from agent import engine_state, engines
from agent.metrics import NodeCollector
from contracts.version import VERSION

from .scrape import samples, value
from .services import free_port
from .support.processes import BASE_DIR, node_env, start_agent

TOKEN = "a-nodes-scrape-token"

# What vLLM's /metrics looks like, in part: its own names and its own labels.
VLLM_METRICS = b"""# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="qwen"} 3.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{model_name="qwen"} 1234.0
"""


@pytest.mark.django_db(transaction=True)
def test_the_agent_serves_its_nodes_metrics_behind_its_token(enrolled_node, agent_cache, tmp_path):
    name, token = enrolled_node
    port = free_port()
    agent = start_agent(
        name,
        token,
        agent_cache,
        tmp_path,
        LLMGW_AGENT_METRICS_ADDR=f"127.0.0.1:{port}",
        LLMGW_AGENT_METRICS_TOKEN=TOKEN,
    )
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        assert requests.get(url, timeout=5).status_code == 401
        assert requests.get(url, headers={"Authorization": "Bearer nope"}, timeout=5).status_code == 401
        answer = requests.get(url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5)
        assert answer.status_code == 200
        found = samples(answer.text)
        assert value(found, "llmgw_agent_info", node=name, version=VERSION) == 1
        assert value(found, "llmgw_agent_memory_bytes", node=name, kind="total") > 0
        assert value(found, "llmgw_agent_disk_free_bytes", node=name) > 0
        assert value(found, "llmgw_agent_engine_installed", node=name, engine="llamacpp") == 1
    finally:
        agent.stop()


def test_an_agent_metrics_address_open_to_other_hosts_needs_a_token(tmp_path):
    env = node_env(
        LLMGW_NODE_TOKEN="llmgw-node-x",
        LLMGW_AGENT_METRICS_ADDR=f"0.0.0.0:{free_port()}",
        LLMGW_AGENT_METRICS_TOKEN="",
    )
    done = subprocess.run(
        [sys.executable, "manage.py", "agent", "--node", "n1", "--cache", str(tmp_path)],
        env=env,
        cwd=BASE_DIR,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "needs LLMGW_AGENT_METRICS_TOKEN" in done.stderr


@pytest.fixture
def engine_metrics():
    """A stand-in for a running engine's /metrics: a process group that is alive, and a port that answers."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(VLLM_METRICS)))
            self.end_headers()
            self.wfile.write(VLLM_METRICS)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    # A GPU engine cannot run here: a sleeping process stands for its process group.
    process = subprocess.Popen(["sleep", "60"], start_new_session=True)
    yield process.pid, server.server_address[1]
    process.kill()
    process.wait()
    server.shutdown()


def test_each_engines_own_metrics_are_passed_on_under_its_replica_and_model(tmp_path, engine_metrics):
    pid, port = engine_metrics
    with engine_state.locked_state(tmp_path) as state:
        state["replicas"]["7"] = {
            "replica": 7,
            "model": "qwen",
            "engine": "vllm",
            "wanted": True,
            "pid": pid,
            "pid_started": engines.start_time(pid),
            "port": port,
            "ready": True,
            "restarts": 2,
        }
    registry = CollectorRegistry(auto_describe=False)
    registry.register(NodeCollector("n1", tmp_path, {"engines": ["vllm"], "gpus": [{"name": "H100"}]}))
    found = samples(generate_latest(registry).decode())
    assert value(found, "llmgw_agent_replica_up", node="n1", replica=7, model="qwen", engine="vllm") == 1
    assert value(found, "llmgw_agent_replica_restarts", node="n1", replica=7, model="qwen") == 2
    assert value(found, "llmgw_agent_replica_memory_bytes", node="n1", replica=7, model="qwen") > 0
    assert value(found, "llmgw_agent_gpus", node="n1") == 1
    labels = {"model_name": "qwen", "node": "n1", "replica": "7", "model": "qwen"}
    assert value(found, "vllm:num_requests_running", **labels) == 3
    assert value(found, "vllm:prompt_tokens_total", **labels) == 1234
