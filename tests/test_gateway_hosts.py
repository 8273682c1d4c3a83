"""Two gateways on two hosts (network namespaces) behind the shipped nginx site: one SIGKILLed under load.

The gateways run `manage.py gateway` inside namespaces of their own, reaching the
tests' PostgreSQL, Redis and the replica over the bridge (through TCP relays on the
bridge address: those servers listen on loopback only), each with the spool of its
own host. nginx is `deploy/nginx/llmgw.conf`'s gateway upstream and `/v1/` location,
as shipped, on plain HTTP.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest
import requests
from django.conf import settings
from django.db.models import Sum

from gateway.keys import create_key
from gateway.models import ApiKey, Usage

from . import netns
from .services import free_port
from .support.factories import add_model, add_replica
from .support.gateway import chat, clear_of_minute_boundary, client, until_routed
from .support.processes import BASE_DIR, Process, process_env, wait_until
from .support.tcp_relay import TcpRelay

if reason := netns.unavailable():
    pytest.skip(reason, allow_module_level=True)
NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
if not Path(NGINX).exists():
    pytest.skip("nginx is not installed (scripts/test-deps.sh installs Debian's)", allow_module_level=True)

pytestmark = pytest.mark.django_db(transaction=True)
GATEWAY_PORT = 8080


@pytest.fixture
def hosts(tmp_path):
    fleet = netns.Fleet()
    relays: list[TcpRelay] = []
    started: list[Process] = []
    try:
        yield fleet, relays, started, tmp_path
    finally:
        for process in started:
            process.stop()
        for relay in relays:
            relay.cut()
        fleet.remove()


def start_gateway_on(host: netns.Host, env: dict, log_dir: Path, name: str) -> Process:
    spool = log_dir / f"spool-{host.name}"  # each host's own disk
    environment = process_env(
        LLMGW_GATEWAY_ADDR=f"{host.address}:{GATEWAY_PORT}", LLMGW_GATEWAY_SPOOL=spool, LLMGW_GATEWAY_REFRESH_MS=100
    )
    environment.update(env)
    process = Process(name, host.argv([sys.executable, "manage.py", "gateway"]), environment, log_dir)

    def answers() -> bool:
        assert process.alive(), process.output()
        try:
            return requests.get(f"http://{host.address}:{GATEWAY_PORT}/v1/models", timeout=1).status_code == 401
        except requests.RequestException:
            return False

    wait_until(answers, timeout=30, what=f"{name} on {host.address}")
    return process


def start_nginx(work: Path, gateways: list[str]) -> tuple[subprocess.Popen, str]:
    """The shipped site's gateway upstream and /v1/ location, with these gateways, on a loopback port."""
    site = (BASE_DIR / "deploy" / "nginx" / "llmgw.conf").read_text()
    upstream = re.search(r"^upstream llmgw_gateway \{.*?^\}", site, re.M | re.S).group(0)
    location = re.search(r"^    location /v1/ \{.*?^    \}", site, re.M | re.S).group(0)
    for example, address in zip(("10.0.0.31:8080", "10.0.0.32:8080"), gateways, strict=True):
        upstream = upstream.replace(example, address)
    port = free_port()
    temp = " ".join(f"{kind}_temp_path {work / kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    (work / "nginx.conf").write_text(
        "user root;\ndaemon off;\n"
        + f"pid {work}/nginx.pid;\nerror_log {work}/nginx-error.log;\nevents {{}}\n"
        + f"http {{ access_log off; {temp}\n{upstream}\n"
        + f"server {{ listen 127.0.0.1:{port}; client_max_body_size 33m;\n{location}\n}} }}\n"
    )
    process = subprocess.Popen([NGINX, "-c", str(work / "nginx.conf"), "-p", str(work)], stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert process.poll() is None, (work / "nginx-error.log").read_text()
        try:
            return requests.get(url + "/v1/models", timeout=1).status_code == 401
        except requests.RequestException:
            return False

    wait_until(up, timeout=15, what="nginx in front of the gateways")
    return process, url


def usage_requests(key) -> int:
    return Usage.objects.filter(key=key).aggregate(total=Sum("requests"))["total"] or 0


def test_one_of_two_gateways_on_two_hosts_killed_under_load_behind_nginx_fails_no_new_request(hosts, replicas):
    fleet, relays, started, tmp_path = hosts
    replica = replicas()
    db = settings.DATABASES["default"]
    redis_url = urlparse(settings.REDIS_URL)
    for target in ((db["HOST"], int(db["PORT"])), (redis_url.hostname, redis_url.port), ("127.0.0.1", replica.port)):
        relays.append(TcpRelay(target, listen=fleet.address))
    (pg_host, pg_port), (redis_host, redis_port), (replica_host, replica_port) = (r.address for r in relays)
    env = {
        "DATABASE_URL": f"postgres://{db['USER']}@{pg_host}:{pg_port}/{db['NAME']}",
        "REDIS_URL": f"redis://{redis_host}:{redis_port}/0",
    }
    add_model()
    add_replica("chat", f"http://{replica_host}:{replica_port}/v1")
    key, secret = create_key("k")
    limited, limited_secret = create_key("limited")
    ApiKey.objects.filter(pk=limited.pk).update(requests_per_minute=30)
    one, two = fleet.add_host("gw1"), fleet.add_host("gw2")
    gateways = [start_gateway_on(one, env, tmp_path, "gateway-1"), start_gateway_on(two, env, tmp_path, "gateway-2")]
    started += gateways
    urls = [f"http://{h.address}:{GATEWAY_PORT}" for h in (one, two)]
    nginx, url = start_nginx(tmp_path, [f"{h.address}:{GATEWAY_PORT}" for h in (one, two)])
    try:
        for gateway_url in urls:
            until_routed(client(secret), gateway_url)
        # A key's limit is one count for both hosts: 30 a minute is 30, asked of both in turn.
        clear_of_minute_boundary()
        statuses = [chat(client(limited_secret), urls[i % 2]).status_code for i in range(50)]
        assert statuses == [200] * 30 + [429] * 20, statuses

        # Load through nginx; gateway 1 killed with SIGKILL in the middle of it.
        outcomes: list[tuple[float, int | str]] = []
        stop = threading.Event()

        def ask() -> None:
            session = client(secret)
            while not stop.is_set():
                began = time.monotonic()
                try:
                    status: int | str = chat(session, url).status_code
                except requests.RequestException as error:
                    status = repr(error)
                outcomes.append((began, status))

        threads = [threading.Thread(target=ask, daemon=True) for _ in range(6)]
        for thread in threads:
            thread.start()
        wait_until(lambda: len(outcomes) > 100, timeout=30, what="load through nginx")
        gateways[0].kill()  # SIGKILL, and waited for: from here on it is gone
        killed_at = time.monotonic()
        wait_until(lambda: len([o for o in outcomes if o[0] > killed_at + 0.5]) > 300, timeout=60, what="more load")
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
        new = [(began - killed_at, status) for began, status in outcomes if began > killed_at]
        assert [n for n in new if n[1] != 200] == [], "requests begun after the kill failed (seconds after, status)"
        # Only the requests gateway 1 was answering when it died may have failed: one per client at most.
        failed = [status for _, status in outcomes if status != 200]
        assert len(failed) <= len(threads), failed
        # The killed gateway's journal is on its host's disk: started again there (systemd's
        # Restart=always), it writes what the killed process had journaled, and nothing twice.
        started.append(start_gateway_on(one, env, tmp_path, "gateway-1-again"))
        answered = sum(1 for _, status in outcomes if status == 200)
        wait_until(lambda: usage_requests(key) >= answered, timeout=30, what="the usage of both gateways")
        assert usage_requests(key) == answered
    finally:
        nginx.terminate()
        nginx.wait(timeout=10)
