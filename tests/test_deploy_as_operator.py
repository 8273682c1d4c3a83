"""The fleet deployed as docs/fleet.md and deploy/ say, by the steps an operator follows (issue 41)."""

from __future__ import annotations

import json
import secrets
import shutil
from pathlib import Path

import pytest
import redis
import requests
import yaml

from fleet.models import Replica
from launcher.demo_model import write_tiny_llama

from .fleet_netns import free_port_on
from .netns import Fleet, unavailable
from .services import free_port
from .support import deploy
from .support.database import db_access  # noqa: F401  (a fixture)
from .support.other_mirror import OtherMirror
from .support.processes import BASE_DIR, Process
from .support.processes import test_database_url as database_url
from .support.waiting import wait_until

pytestmark = [
    pytest.mark.skipif(bool(unavailable()), reason=unavailable() or ""),
    pytest.mark.skipif(shutil.which("nft") is None, reason="nft is not installed (scripts/test-deps.sh installs it)"),
    pytest.mark.engine,
]


@pytest.fixture(scope="module")
def fleet():
    made = Fleet()
    yield made
    made.remove()


def test_the_control_hosts_firewall_keeps_loopback_replies_and_ssh_and_drops_the_rest(fleet):
    control, node, stranger = (fleet.add_host(label) for label in ("fw-control", "fw-node", "fw-stranger"))
    deploy.apply_firewall(control.name, deploy.firewall("control", {"10.0.0.21": node.address}))
    listeners = [
        deploy.listen(control.name, "127.0.0.1", 6379),  # Redis on the host's loopback
        deploy.listen(control.name, "0.0.0.0", 22),
        deploy.listen(control.name, "0.0.0.0", 8001),  # the byte listener, for nodes
        deploy.listen(control.name, "0.0.0.0", 8000),  # a port not listed
        deploy.listen(stranger.name, "0.0.0.0", 8000),  # somebody the control host calls
    ]
    try:
        assert deploy.connects(control.name, "127.0.0.1", 6379), "loopback is dropped"
        assert deploy.connects(control.name, stranger.address, 8000), "the reply to a connection it made is dropped"
        assert deploy.connects(stranger.name, control.address, 22), "SSH is dropped: the operator is locked out"
        assert deploy.connects(node.name, control.address, 8001)
        # and what is not listed is dropped, for a stranger and a node alike
        assert not deploy.connects(stranger.name, control.address, 8001, timeout=1)
        assert not deploy.connects(node.name, control.address, 8000, timeout=1)
    finally:
        for listener in listeners:
            listener.kill()
            listener.wait()


# --- The fleet, deployed as docs/fleet.md says ---

SECRET = secrets.token_urlsafe(50)
# What Prometheus presents: to the admin server and the gateways, and to the nodes' agents.
METRICS_TOKEN = secrets.token_urlsafe(32)
AGENT_METRICS_TOKEN = secrets.token_urlsafe(32)


class Deployed:
    """What the walk below made: the hosts, their addresses, the URLs an operator would use."""

    def __init__(self, fleet, work: Path):
        self.work = work
        deploy.namespaces_dir(work)
        # The control host keeps this machine's network: PostgreSQL (the suite's) is on its loopback.
        self.control = deploy.DeployedHost("control", work, None, fleet.address)
        node_ns = fleet.add_host("node-1")
        self.node = deploy.DeployedHost("node-1", work, node_ns.name, node_ns.address)
        self.hosts = [self.control, self.node]
        # Redis on the control host, on the fleet's address (a free port of this machine where the guide has 6379).
        self.redis_address = f"{fleet.address}:{free_port_on(fleet.address)}"
        self.gateway_redis_url = ""  # what `llmgw-manage redis_acl --url gateway-gw1` printed
        self.redis: Process | None = None
        self.admin_url = f"http://127.0.0.1:{free_port()}"
        self.bytes_url = f"http://{fleet.address}:{free_port_on(fleet.address)}/"
        self.gateway_url = f"http://{fleet.address}:{free_port_on(fleet.address)}"

    def control_redis_url(self) -> str:
        return deploy.read_env_file_on(self.control, "/etc/llmgw/control.env")["REDIS_URL"]

    def remove(self) -> None:
        for host in reversed(self.hosts):  # the nodes first, then the control host's services, its Redis last
            host.remove()
        deploy.remove_namespaces_dir(self.work)


def _install_control(deployed: Deployed) -> None:
    """Step 1 of docs/fleet.md on `control`, from `useradd` to `systemctl enable --now`, in the guide's order."""
    control, guide = deployed.control, deploy.GuideReader()
    control.run(guide.line("useradd --system --home-dir /var/lib/llmgw"))
    control.clone()
    control.run(guide.line("mkdir -p /srv/llmgw/mirror /etc/llmgw"))
    control.run(guide.line("install -m 0640 -g llmgw deploy/env/control.env"))
    admin_port = deployed.admin_url.rsplit(":", 1)[1]
    bytes_address = deployed.bytes_url.removeprefix("http://").rstrip("/")
    deploy.edit_env_file(
        control,
        "/etc/llmgw/control.env",
        {
            "DJANGO_SECRET_KEY": SECRET,
            "DATABASE_URL": database_url(),  # the suite's PostgreSQL (createuser/createdb: tests/test_postgres.py)
            # The guide's example address replaced by this fleet's; user and password are `redis_acl`'s, below.
            "REDIS_URL": f"redis://llmgw-control:change-me@{deployed.redis_address}/0",
            "LLMGW_BYTES_REDIS_URL": f"redis://llmgw-bytes:change-me@{deployed.redis_address}/0",
            "LLMGW_ADMIN_ADDR": f"127.0.0.1:{admin_port}",
            "LLMGW_BYTES_ADDR": bytes_address,
            "LLMGW_BYTES_URL": deployed.bytes_url,
            "LLMGW_METRICS_TOKEN": METRICS_TOKEN,
        },
        lab={
            "LLMGW_GATEWAY_URL": deployed.gateway_url + "/",
            # The pull below is from a mirror on this machine, over plain HTTP, as control.env says to allow.
            "LLMGW_PULL_ALLOW_HTTP": "true",
            # This test's pace: a scan every second, placement every second.
            "LLMGW_SCAN_INTERVAL_S": "1",
            "LLMGW_RECONCILE_INTERVAL_S": "1",
            "LLMGW_DEMO_MODEL": "false",
            "LLMGW_MIRROR_SETTLE_S": "1",
        },
    )
    control.run(guide.line("install -m 0755 deploy/llmgw-manage"))
    # The first llmgw-manage, before any unit ran (issue 41 item 4).
    control.run(guide.line("llmgw-manage check --deploy"))
    _install_redis(deployed, guide)
    # The units the guide enables, as it lists them (the scheduler, llmgw-beat, among them).
    for unit in guide.line("systemctl enable --now llmgw-admin").split()[3:]:
        control.start_unit(unit)


def _install_redis(deployed: Deployed, guide: deploy.GuideReader) -> None:
    """Step 1's Redis: a user per principal, each process's URL printed by `redis_acl`, the users file loaded."""
    control = deployed.control
    control.run(guide.line("llmgw-manage migrate"))
    printed = {}
    for user in ("llmgw-control", "llmgw-bytes", "gateway-gw1"):
        printed[user] = control.run(guide.line(f"llmgw-manage redis_acl --url {user}")).strip().splitlines()[-1]
    deploy.edit_env_file(
        control,
        "/etc/llmgw/control.env",
        {"REDIS_URL": printed["llmgw-control"], "LLMGW_BYTES_REDIS_URL": printed["llmgw-bytes"]},
    )
    deployed.gateway_redis_url = printed["gateway-gw1"]
    control.run(guide.line("(umask 077; llmgw-manage redis_acl --gateway gw1"))
    control.run(guide.line("chown redis:redis /etc/redis/users.acl"))
    control.run(guide.line("install -m 0644 -D deploy/redis/llmgw.conf"))
    control.run(guide.line("echo 'include /etc/redis/conf.d/llmgw.conf'"))
    # This fleet's address where the guide has 10.0.0.10, and a free port of this machine where Redis's is 6379:
    # on the fleet's address alone, as a port free there may be taken on this machine's loopback.
    conf = control.read("/etc/redis/conf.d/llmgw.conf")
    host, port = deployed.redis_address.split(":")
    assert "\nbind 127.0.0.1 10.0.0.10\n" in conf, conf
    control.write(
        "/etc/redis/conf.d/llmgw.conf", conf.replace("\nbind 127.0.0.1 10.0.0.10\n", f"\nbind {host}\nport {port}\n")
    )
    guide.line("systemctl restart redis-server")
    _start_redis(deployed)


def _start_redis(deployed: Deployed) -> None:
    """`systemctl restart redis-server`: what Debian's redis-server.service runs (User=redis, UMask=007,
    RuntimeDirectory=redis; its ReadWriteDirectories=/etc/redis lets ACL SAVE write the users file)."""
    control, before = deployed.control, deployed.redis
    if before is not None:
        before.stop()
    control.run("install -d -o redis -g redis -m 2755 /run/redis")
    redis_server = "/usr/bin/redis-server /etc/redis/redis.conf --daemonize no"
    started = deployed.redis = control.start(
        "redis", ["sh", "-c", f"umask 007 && exec setpriv --reuid=redis --regid=redis --init-groups {redis_server}"]
    )
    if before is not None:  # in the stopped one's place: the services that need it are stopped before it
        control.processes.remove(started)
        control.processes[control.processes.index(before)] = started
    control_url = deployed.control_redis_url()

    def answers() -> bool:
        assert started.alive(), f"redis-server exited:\n{started.output()[-3000:]}"
        try:
            return redis.Redis.from_url(control_url, socket_timeout=5).ping()
        except redis.ConnectionError:
            return False

    wait_until(answers, timeout=60, what="the deployed Redis to answer llmgw-control")


def _install_gateway(deployed: Deployed) -> None:
    """Step 1b, on the control host (a gateway host of its own would run the same unit)."""
    control = deployed.control
    control.run(deploy.doc_line("mkdir -p /etc/llmgw && install -m 0640 -g llmgw deploy/env/gateway.env"))
    deploy.edit_env_file(
        control,
        "/etc/llmgw/gateway.env",
        {
            "DATABASE_URL": database_url(),
            "REDIS_URL": deployed.gateway_redis_url,
            "DJANGO_SECRET_KEY": SECRET,
            "LLMGW_GATEWAY_ADDR": deployed.gateway_url.removeprefix("http://"),
            "LLMGW_GATEWAY_URL": deployed.gateway_url + "/",
            "LLMGW_METRICS_TOKEN": METRICS_TOKEN,
        },
        lab={"LLMGW_GATEWAY_REFRESH_MS": "200"},
    )
    control.start_unit("llmgw-gateway")


def _install_node(deployed: Deployed) -> None:
    """Steps 2 and 3: the node's token on control, then the node's own install."""
    node = deployed.node
    token = deployed.control.run(f"llmgw-manage node_token {node.name} --address {node.address}").strip()
    node.run(deploy.doc_line("useradd --system --home-dir /var/lib/llmgw"))
    node.clone()
    # `python3 -m venv .venv && pip install -r requirements/node.txt`: the checkout's venv is used as it is.
    node.run(deploy.doc_line("sh scripts/build-engine.sh"))
    node.run(deploy.doc_line("useradd --system --gid llmgw --no-create-home"))
    node.run(deploy.doc_line("mkdir -p /etc/llmgw && install -m 0600 -o root -g root deploy/env/node.env"))
    deploy.edit_env_file(
        node,
        "/etc/llmgw/node.env",
        {
            "LLMGW_NODE_TOKEN": token.splitlines()[-1],
            # The guide's example address replaced by this fleet's; no password (LLMGW_REDIS_ACL=true, as shipped).
            "REDIS_URL": f"redis://{deployed.redis_address}/0",
            "LLMGW_BYTES_URL": deployed.bytes_url,
            "LLMGW_ENGINE_ADVERTISE": node.address,
            "LLMGW_AGENT_METRICS_TOKEN": AGENT_METRICS_TOKEN,
        },
        lab={"LLMGW_HEARTBEAT_S": "1"},
    )
    example = {"10.0.0.10": deployed.control.address, "10.0.0.31": deployed.control.address, "10.0.0.21": node.address}
    deploy.apply_firewall(node.netns, deploy.firewall("node", example))
    node.start_unit("llmgw-agent", node=node.name)


@pytest.fixture(scope="module")
def deployed(fleet, tmp_path_factory, db_access):  # noqa: F811  (the fixture imported above)
    made = Deployed(fleet, tmp_path_factory.mktemp("deployed"))
    try:
        # In the guide's order: the control plane, a gateway, then the node with its token.
        _install_control(made)
        _install_gateway(made)
        _install_node(made)
        yield made
    finally:
        made.remove()


def _processes_alive(deployed: Deployed) -> None:
    for host in deployed.hosts:
        for process in host.processes:
            assert process.alive(), f"{process.name} exited:\n{process.output()[-3000:]}"


def test_a_node_deployed_as_the_guide_says_enrols_with_llama_cpp(deployed):
    """Its llama-server outside root's home, which the agent's user cannot reach (issue 41 item 2)."""
    from fleet.models import Node

    def ready():
        _processes_alive(deployed)
        node = Node.objects.filter(name=deployed.node.name).first()
        return node is not None and node.state == Node.State.READY and "llamacpp" in node.engines

    wait_until(ready, timeout=90, what="node-1 ready with llama.cpp")


def test_the_deployed_redis_refuses_a_client_without_a_user_and_a_principal_outside_its_keys(deployed):
    """The guide's users are in force: `default` is off, a node's user and a gateway's reach only their own keys."""
    from contracts import credentials
    from fleet.models import Node

    anonymous = redis.Redis.from_url(f"redis://{deployed.redis_address}/0", socket_timeout=10)
    with pytest.raises(redis.AuthenticationError):  # NOAUTH: `user default off`
        anonymous.get("llmgw:limit:anything")
    token_hash = Node.objects.get(name=deployed.node.name).token_hash
    node_url = credentials.node_redis_url(f"redis://{deployed.redis_address}/0", deployed.node.name, token_hash)
    as_node = redis.Redis.from_url(node_url, socket_timeout=10)
    assert as_node.ping(), "the node's own user (made by node_token) is refused"
    with pytest.raises(redis.exceptions.NoPermissionError):
        as_node.get("llmgw:limit:anything")  # a gateway's key
    with pytest.raises(redis.exceptions.NoPermissionError):
        redis.Redis.from_url(deployed.gateway_redis_url, socket_timeout=10).llen(f"node.{deployed.node.name}")


def _staff(deployed: Deployed) -> requests.Session:
    """An operator's API token (`llmgw-manage createsuperuser`, `llmgw-manage api_token`), as behind nginx."""
    control = deployed.control
    control.run(
        "llmgw-manage createsuperuser --noinput --username operator --email operator@example.org",
        DJANGO_SUPERUSER_PASSWORD=secrets.token_urlsafe(16),
    )
    token = control.run("llmgw-manage api_token operator").strip().splitlines()[-1]
    session = requests.Session()
    # What nginx adds (deploy/nginx/llmgw.conf): the public name, and that the client came over HTTPS.
    session.headers.update(
        {"Authorization": f"Token {token}", "Host": "llmgw.example.org", "X-Forwarded-Proto": "https"}
    )
    return session


def test_the_readmes_walk_serves_the_model_a_key_gets_an_answer_through_the_gateway(deployed, tmp_path):
    """Step 4: weights copied into the mirror, served through the API, a key, an answer (issue 41 items 1 and 2)."""
    write_tiny_llama(tmp_path / "gguf")
    deployed.control.run(f"mkdir -p /srv/llmgw/mirror/tiny/v1 && cp {tmp_path}/gguf/*.gguf /srv/llmgw/mirror/tiny/v1/")
    staff = _staff(deployed)

    def plan():
        _processes_alive(deployed)
        offered = staff.get(deployed.admin_url + "/api/serve/plan/?model=tiny&version=v1", timeout=10)
        return offered.json() if offered.status_code == 200 else None

    offer = wait_until(plan, timeout=60, what="the mirror's scan to list tiny/v1")
    served = staff.post(
        deployed.admin_url + "/api/serve/",
        json={
            "name": "tiny",
            "source": offer["source"],
            "engine": offer["engine"],
            "profile": offer["profile"],
            "context_length": "256",
            "replicas": "1",
            "min_memory_gb": offer["min_memory_gb"],
        },
        timeout=30,
    )
    assert served.status_code == 201, served.text
    key = deployed.control.run("llmgw-manage api_key create first-client | tail -n 1").strip()

    def answered():
        _processes_alive(deployed)
        asked = requests.post(
            deployed.gateway_url + "/v1/chat/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": "tiny", "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 4},
            timeout=30,
        )
        return asked if asked.status_code == 200 else None

    answer = wait_until(answered, timeout=120, interval=1, what="an answer from tiny through the gateway")
    assert answer.json()["choices"][0]["message"]["role"] == "assistant"
    assert answer.json()["usage"]["completion_tokens"] > 0
    replica = Replica.objects.get(model_name="tiny")
    assert replica.endpoint.startswith(f"http://{deployed.node.address}:")


def test_a_pull_from_another_mirror_lands_in_the_mirror_the_other_units_only_read(deployed, tmp_path, settings):
    """The admin's "Pull a version" runs on the pulls unit, the one that may write the mirror (issue 41 item 5)."""
    from llmgw_site.celery import app
    from mirror import pull
    from mirror.models import MirrorPull
    from mirror.tasks import pull_task

    other = OtherMirror(tmp_path / "other")
    try:
        url = other.add("pulled", "v1", {"weights.gguf": secrets.token_bytes(300_000)})
        # What the page does on its form's POST (mirror/views.py), with control.env's settings as edited above:
        # the pull recorded, its id onto the broker.
        settings.PULL_ALLOW_HTTP = True
        record = pull.start(url, requested_by="operator")
        with app.connection_for_write(deployed.control_redis_url()) as broker:
            pull_task.apply_async((record.pk,), connection=broker)

        def ended():
            _processes_alive(deployed)
            record.refresh_from_db()
            return record.state in (MirrorPull.State.DONE, MirrorPull.State.FAILED)

        # Generous: the pulls unit shares two cores with the whole deployed fleet and the suite's other workers.
        wait_until(
            ended,
            timeout=240,
            what=lambda: f"the pull to end on llmgw-pulls (it is {record.state}: {record.error or 'no sentence'})",
        )
        assert record.state == MirrorPull.State.DONE, record.error
        assert deployed.control.run("ls /srv/llmgw/mirror/pulled/v1").split() == ["weights.gguf"]
    finally:
        other.stop()


# --- Step 5: Prometheus on the control host, through nginx, and the dashboard ---

PUBLIC_NAME = "llmgw.example.org"  # the name on nginx's certificate, as deploy/ spells it


def _install_nginx(deployed: Deployed) -> str:
    """Step 1's TLS proxy on `control`, deploy/nginx/llmgw.conf with this fleet's one control host and one gateway.

    The lab's differences: its ports are free ones of this machine (the control host shares its
    network), and its certificate is made here and put in the host's trust store, where a
    public CA's certificate already is.
    """
    control = deployed.control
    control.run(deploy.doc_line("install -m 0644 deploy/nginx/llmgw.conf"))
    control.run(deploy.doc_line("ln -s ../sites-available/llmgw.conf"))
    control.run(
        "mkdir -p /etc/ssl/llmgw && openssl req -x509 -newkey rsa:2048 -nodes -days 1 "
        f"-subj /CN={PUBLIC_NAME} -addext subjectAltName=DNS:{PUBLIC_NAME} "
        "-keyout /etc/ssl/llmgw/privkey.pem -out /etc/ssl/llmgw/fullchain.pem 2>/dev/null"
        " && cat /etc/ssl/llmgw/fullchain.pem >> /etc/ssl/certs/ca-certificates.crt"
    )
    # Its DNS name: this host's address on the fleet's network.
    control.run(f"echo '{control.address} {PUBLIC_NAME}' >> /etc/hosts")
    https_port, http_port = free_port_on(control.address), free_port_on(control.address)
    site = control.read("/etc/nginx/sites-available/llmgw.conf")
    lines = []
    for line in site.splitlines():
        if "listen [::]" in line or "10.0.0.11:8000" in line or "10.0.0.32:8080" in line:
            continue  # no IPv6 here, one control host, one gateway
        line = line.replace("listen 443 ", f"listen {control.address}:{https_port} ")
        line = line.replace("listen 80;", f"listen {control.address}:{http_port};")
        line = line.replace("10.0.0.10:8000", deployed.admin_url.removeprefix("http://"))
        lines.append(line.replace("10.0.0.31:8080", deployed.gateway_url.removeprefix("http://")))
    control.write("/etc/nginx/sites-available/llmgw.conf", "\n".join(lines))
    control.run(deploy.doc_line("nginx -t && systemctl reload nginx").split(" && ")[0] + " 2>&1")
    control.start("nginx", ["nginx", "-g", "daemon off;"])
    return f"{PUBLIC_NAME}:{https_port}"


def _install_prometheus(deployed: Deployed) -> str:
    """Step 5 on `control`: Debian's Prometheus with deploy/prometheus.yml, this fleet's hosts listed in it."""
    control, node = deployed.control, deployed.node
    public = _install_nginx(deployed)
    control.run(deploy.doc_line("install -m 0644 deploy/prometheus.yml"))
    control.run(deploy.doc_line("install -m 0640 -g prometheus /dev/null /etc/prometheus/llmgw-metrics-token"))
    control.run(deploy.doc_line("sed -n 's/^LLMGW_METRICS_TOKEN=//p'"))
    control.run(deploy.doc_line("install -m 0640 -g prometheus /dev/null /etc/prometheus/llmgw-agent-token"))
    control.write("/etc/prometheus/llmgw-agent-token", AGENT_METRICS_TOKEN)
    metrics_addr = deploy.read_env_file_on(node, "/etc/llmgw/node.env").get("LLMGW_AGENT_METRICS_ADDR", "")
    assert metrics_addr, (
        "node.env leaves the node's /metrics off (LLMGW_AGENT_METRICS_ADDR): the node panels stay empty"
    )
    node_port = metrics_addr.rsplit(":", 1)[1]
    hosts = {
        "llmgw-control": [public],
        "llmgw-gateways": [deployed.gateway_url.removeprefix("http://")],
        "llmgw-nodes": [f"{node.address}:{node_port}"],
    }
    config = yaml.safe_load(control.read("/etc/prometheus/prometheus.yml"))
    config["global"]["scrape_interval"] = "1s"  # this test's pace
    for job in config["scrape_configs"]:
        job["static_configs"] = [{"targets": hosts.pop(job["job_name"])}]
    assert not hosts, f"deploy/prometheus.yml has no job {sorted(hosts)}"
    control.write("/etc/prometheus/prometheus.yml", yaml.safe_dump(config))
    control.run(deploy.doc_line("promtool check config").split(" && ")[0])
    # What Debian's prometheus.service runs (User=prometheus); its port one of this machine's free ones.
    url = f"http://127.0.0.1:{free_port()}"
    argv = ["setpriv", "--reuid=prometheus", "--regid=prometheus", "--init-groups", "/usr/bin/prometheus"]
    argv += ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/var/lib/prometheus/metrics2/"]
    prometheus = control.start("prometheus", [*argv, f"--web.listen-address={url.removeprefix('http://')}"])

    def ready():
        assert prometheus.alive(), prometheus.output()[-3000:]
        try:
            return requests.get(url + "/-/ready", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    wait_until(ready, timeout=60, what="Prometheus to be ready")
    return url


def _query(prometheus: str, expr: str) -> list[dict]:
    answer = requests.get(prometheus + "/api/v1/query", params={"query": expr}, timeout=10).json()
    assert answer["status"] == "success", (expr, answer)
    return answer["data"]["result"]


def test_prometheus_scrapes_every_target_of_the_deployed_fleet_and_no_panel_of_the_dashboard_is_empty(deployed):
    """The README walk's last step (issue 41 item 7): each job of deploy/prometheus.yml up, each panel a line."""
    assert Replica.objects.filter(model_name="tiny").exists(), "this step follows the walk above, which serves tiny"
    prometheus = _install_prometheus(deployed)
    key = deployed.control.run("llmgw-manage api_key create prometheus-walk | tail -n 1").strip()
    ask = {"model": "tiny", "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 2}

    def some_traffic() -> None:
        """An answer, a streamed one (the time to first token) and one refused (the errors), through the gateway."""
        for body, bearer in ((ask, key), ({**ask, "stream": True}, key), (ask, "not-a-key")):
            requests.post(
                deployed.gateway_url + "/v1/chat/completions",
                headers={"Authorization": f"Bearer {bearer}"},
                json=body,
                timeout=30,
            )

    def targets() -> dict[str, str]:
        found = requests.get(prometheus + "/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
        return {f"{t['labels']['job']} {t['scrapeUrl']}": t["lastError"] or t["health"] for t in found}

    some_traffic()
    wait_until(
        lambda: set(targets().values()) == {"up"},
        timeout=90,
        interval=0.5,
        what=lambda: f"every target of deploy/prometheus.yml up, not {targets()}",
    )

    dashboard = json.loads((BASE_DIR / "deploy" / "grafana" / "llmgw.json").read_text())
    panels = [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel["targets"]]

    def empty_panels() -> list[str]:
        empty = [f"{title}: {expr}" for title, expr in panels if not _query(prometheus, expr.replace("$model", ".*"))]
        if empty:
            # A gateway's processes count alone (docs/observability.md): a scrape may reach one that has not answered yet.
            some_traffic()
        return empty

    wait_until(
        lambda: not empty_panels(),
        timeout=120,
        interval=1,
        what=lambda: "a series for every panel of deploy/grafana/llmgw.json; empty:\n" + "\n".join(empty_panels()),
    )
    # The fleet's gauges come from the control plane alone: the gateway does not show the one node twice.
    exporters = sorted(row["metric"]["job"] for row in _query(prometheus, "count by (job) (llmgw_nodes)"))
    assert exporters == ["llmgw-control"], f"the fleet's gauges come from {exporters}: each beside the first repeats it"
    assert _query(prometheus, "sum(llmgw_nodes)")[0]["value"][1] == "1", "the one node is not counted once"
    # And the refused request is counted as what it was (in the samples of whichever gateway process took it).
    refused = _query(prometheus, 'last_over_time(llmgw_gateway_requests_total{status="401"}[5m])')
    assert refused, "the request with a wrong key is not counted"


def test_the_users_file_printed_again_is_what_redis_serves_after_the_restart_the_guide_says(deployed):
    """A second gateway's user, as a gateway added (or a new secret key) is loaded: not `redis-cli ACL LOAD`, refused."""
    from contracts import credentials
    from fleet.models import Node

    control = deployed.control
    host, port = deployed.redis_address.split(":")
    # What the guide said before: refused, as no user is named and `default` is off.
    assert "NOAUTH" in control.run(f"redis-cli -h {host} -p {port} ACL LOAD 2>&1 || true")
    control.run(deploy.doc_line("(umask 077; llmgw-manage redis_acl --gateway gw1 --gateway gw2"))
    control.run(deploy.doc_line("chown redis:redis /etc/redis/users.acl"))
    deploy.doc_line("systemctl restart redis-server   # the enrolled nodes")
    _start_redis(deployed)
    gw2 = control.run("llmgw-manage redis_acl --url gateway-gw2").strip().splitlines()[-1]
    assert redis.Redis.from_url(gw2, socket_timeout=10).ping(), "the added gateway's user is not in force"
    token_hash = Node.objects.get(name=deployed.node.name).token_hash
    node_url = credentials.node_redis_url(f"redis://{deployed.redis_address}/0", deployed.node.name, token_hash)
    assert redis.Redis.from_url(node_url, socket_timeout=10).ping(), "the enrolled node's user is lost"
