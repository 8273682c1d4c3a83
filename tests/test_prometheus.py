"""Debian's Prometheus, configured from deploy/prometheus.yml, scraping a running llmgw and one of its nodes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import requests
import yaml

from gateway.keys import create_key

from .services import free_port
from .support.factories import add_model, add_replica
from .support.gateway import chat, client, until_routed
from .support.gateway_process import start_gateway
from .support.processes import BASE_DIR, Process, start_admin_server, start_agent
from .support.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

CONTROL_TOKEN = "the-control-planes-scrape-token"
NODE_TOKEN = "the-nodes-scrape-token"


def prometheus_config(tmp_path: Path, control: str, node: str, gateway: str) -> Path:
    """The shipped deploy/prometheus.yml with this test's targets, token files and a 1 s interval."""
    config = yaml.safe_load((BASE_DIR / "deploy" / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = "1s"
    targets = {"llmgw-control": control, "llmgw-nodes": node, "llmgw-gateways": gateway}
    tokens = {"llmgw-control": CONTROL_TOKEN, "llmgw-nodes": NODE_TOKEN, "llmgw-gateways": CONTROL_TOKEN}
    for job in config["scrape_configs"]:
        name = job["job_name"]
        job["static_configs"] = [{"targets": [targets[name]]}]
        token_file = tmp_path / f"{name}.token"
        token_file.write_text(tokens[name])
        job["authorization"]["credentials_file"] = str(token_file)
        # The control job goes through the TLS proxy (nginx) in a fleet; here it reaches the admin port itself.
        assert job.get("scheme", "http") == ("https" if name == "llmgw-control" else "http"), name
        job["scheme"] = "http"
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture
def prometheus(tmp_path):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("this test needs Debian's prometheus: `make test` installs it, or apt-get install prometheus")
    started = []

    def start(config: Path) -> str:
        port = free_port()
        argv = [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ]
        process = Process("prometheus", argv, {"PATH": "/usr/bin:/bin"}, tmp_path)
        started.append(process)
        url = f"http://127.0.0.1:{port}"

        def ready():
            assert process.alive(), process.output()
            try:
                return requests.get(url + "/-/ready", timeout=1).status_code == 200
            except requests.RequestException:
                return False

        wait_until(ready, timeout=30, what="prometheus to be ready")
        return url

    yield start
    for process in started:
        process.stop()


def query(url: str, expr: str) -> list[dict]:
    answer = requests.get(url + "/api/v1/query", params={"query": expr}, timeout=10).json()
    assert answer["status"] == "success", (expr, answer)
    return answer["data"]["result"]


def test_prometheus_scrapes_the_control_plane_and_a_node_and_counts_the_requests_sent(
    prometheus,
    enrolled_node,
    agent_cache,
    tmp_path,
    replicas,  # noqa: F811
):
    admin, admin_url = start_admin_server(tmp_path, LLMGW_METRICS_TOKEN=CONTROL_TOKEN)
    gateway, gateway_url = start_gateway(tmp_path, LLMGW_METRICS_TOKEN=CONTROL_TOKEN)
    name, token = enrolled_node
    node_port = free_port()
    agent = start_agent(
        name,
        token,
        agent_cache,
        tmp_path,
        LLMGW_AGENT_METRICS_ADDR=f"127.0.0.1:{node_port}",
        LLMGW_AGENT_METRICS_TOKEN=NODE_TOKEN,
    )
    try:
        add_model("chat")
        add_model("other")
        add_replica("chat", replicas().base)
        add_replica("other", replicas().base)
        _, secret = create_key("k")
        session = client(secret)
        until_routed(session, gateway_url)
        until_routed(session, gateway_url, "other")
        targets = admin_url.removeprefix("http://"), f"127.0.0.1:{node_port}", gateway_url.removeprefix("http://")
        url = prometheus(prometheus_config(tmp_path, *targets))
        for model, times in (("chat", 3), ("other", 2)):
            for _ in range(times):
                assert chat(session, gateway_url, model=model).status_code == 200

        def both_up():
            targets = requests.get(url + "/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
            return {t["labels"]["job"]: (t["health"], t["lastError"]) for t in targets}

        wait_until(
            lambda: both_up() == {"llmgw-control": ("up", ""), "llmgw-nodes": ("up", ""), "llmgw-gateways": ("up", "")},
            timeout=30,
            what="the three targets to be scraped without errors",
        )

        def by_model():
            rows = query(url, 'sum by (model) (llmgw_gateway_requests_total{kind="chat", status="200"})')
            return {row["metric"].get("model"): float(row["value"][1]) for row in rows}

        wait_until(lambda: by_model() == {"chat": 3, "other": 2}, timeout=30, what="the requests to be counted")
        assert query(url, f'llmgw_agent_info{{node="{name}"}}')
        assert float(query(url, 'sum(llmgw_nodes{state="ready"})')[0]["value"][1]) >= 0

        # Every panel of the shipped dashboard is a query Prometheus accepts.
        dashboard = json.loads((BASE_DIR / "deploy" / "grafana" / "llmgw.json").read_text())
        for panel in dashboard["panels"]:
            for target in panel["targets"]:
                query(url, target["expr"].replace("$model", ".*"))
    finally:
        agent.stop()
        gateway.stop()
        admin.stop()
