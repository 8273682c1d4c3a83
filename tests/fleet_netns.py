"""The fleet test's processes: a control plane on this host, nodes in their own network namespaces.

The control plane is what `deploy/` runs on its host: the admin server and two
gateways on loopback (two, as behind the operator's load balancer, so that one can be
restarted while the other answers), the byte listener and Redis on the bridge, and
one control worker with its beat. A node is `manage.py agent` run inside its
namespace, with its own cache, no database, and the bridge as its only network.
"""

from __future__ import annotations

import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import requests

from .netns import Fleet, Host
from .services import free_port
from .support.processes import CountingProxy, Process, node_env, process_env, wait_for_status, wait_until

# Short, so that a lost node is found out in seconds: a heartbeat a second, lost after three missed.
TIMING = {"LLMGW_HEARTBEAT_S": "1", "LLMGW_HEARTBEATS_MISSED": "3", "LLMGW_RECONCILE_INTERVAL_S": "1"}
# A replica's host silent this long is gone to the gateway (gateway/upstream.py): a request
# on its way to a node that was cut off goes to the other node after this long.
UPSTREAM_LOST_S = "3"


def free_port_on(address: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


class ControlPlane:
    def __init__(self, fleet: Fleet, mirror: Path, log_dir: Path, *, whole: bool = True, **extra_env: str):
        self.whole = whole
        self.fleet = fleet
        self.mirror = mirror
        self.log_dir = log_dir
        self.redis_port = free_port_on(fleet.address)
        # Off loopback Redis wants a password (its protected mode refuses everyone else), as a fleet's does.
        self.redis_password = secrets.token_hex(16)
        self.redis_url = f"redis://:{self.redis_password}@{fleet.address}:{self.redis_port}/0"
        self.bytes_port = free_port_on(fleet.address)
        self.byte_listener_url = f"http://{fleet.address}:{self.bytes_port}/"
        self.admin_port = free_port()
        self.gateway_ports = [free_port(), free_port()]
        self.extra_env = extra_env
        self.redis: subprocess.Popen | None = None
        self.byte_listener: Process | None = None
        self.worker: Process | None = None
        self.admin: Process | None = None
        self.gateways: list[Process | None] = [None, None]
        # The nodes fetch through this proxy, which can slow a fetch down so that one is
        # in progress when its node is cut off. It is the test's, not the control plane's.
        self.proxy = CountingProxy(self.byte_listener_url, host=fleet.address)
        self.bytes_url = self.proxy.url
        try:
            self.start_redis()
            self.start_byte_listener()
            if whole:  # else Redis and the byte listener only: what a node's fetch needs (tests/test_swarm_fleet.py)
                self.start_worker()
                self.start_admin()
                for i in range(2):
                    self.start_gateway(i)
        except BaseException:
            self.stop()  # what started before the failure; the fixture never got the object to stop
            raise

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    @property
    def gateway_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}" for port in self.gateway_ports]

    def env(self, **more: str) -> dict:
        """deploy/env/control.env filled in for this control plane, with the test's short timings."""
        return process_env(
            REDIS_URL=self.redis_url,
            LLMGW_BYTES_URL=self.bytes_url,
            LLMGW_MIRROR_ROOT=self.mirror,
            LLMGW_SCAN_INTERVAL_S=2,
            LLMGW_GATEWAY_REFRESH_MS=200,
            LLMGW_DEMO_MODEL="false",
            LLMGW_GATEWAY_UPSTREAM_LOST_S=UPSTREAM_LOST_S,
            **TIMING,
            **self.extra_env,
            **more,
        )

    def start_redis(self) -> None:
        argv = ["redis-server", "--bind", self.fleet.address, "--port", str(self.redis_port)]
        argv += ["--requirepass", self.redis_password, "--save", "", "--appendonly", "no", "--dir", str(self.log_dir)]
        log = open(self.log_dir / "redis.log", "ab")
        self.redis = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        import redis

        client = redis.Redis.from_url(self.redis_url, socket_timeout=1)

        def pong():
            try:
                return client.ping()
            except redis.RedisError:
                return False

        wait_until(pong, timeout=10, what="the fleet's Redis on the bridge")

    def start_byte_listener(self) -> None:
        # The nodes reach it through the test's proxy: the tracker takes a node's address from the proxy's word.
        env = self.env(
            LLMGW_BYTES_ADDR=f"{self.fleet.address}:{self.bytes_port}",
            LLMGW_BYTES_WORKERS=1,
            LLMGW_BYTES_TRUSTED_PROXIES=self.fleet.address,
        )
        self.byte_listener = Process("byte-listener", [sys.executable, "manage.py", "byte_listener"], env, self.log_dir)
        # Up: whatever it answers this test process, which holds no node's pass (the tests say what).
        wait_until(lambda: self._answers(self.byte_listener, self.byte_listener_url), what="the byte listener")

    @staticmethod
    def _answers(process: Process, url: str) -> bool:
        if not process.alive():
            raise AssertionError(f"{process.name} exited:\n{process.output()}")
        try:
            return requests.get(url, timeout=1).status_code < 500
        except requests.RequestException:
            return False

    def start_worker(self) -> None:
        argv = [sys.executable, "-m", "celery", "-A", "llmgw_site", "worker", "--beat", "-Q", "control"]
        argv += ["-n", "control@%h", "--concurrency", "2", "--loglevel", "INFO", "--without-gossip"]
        argv += ["--without-mingle", "--schedule", str(self.log_dir / "beat-schedule")]
        self.worker = Process("control-worker", argv, self.env(), self.log_dir)
        wait_until(lambda: "ready." in self.worker.output() or not self.worker.alive(), timeout=60, what="the worker")
        assert self.worker.alive(), self.worker.output()

    def start_admin(self) -> None:
        env = self.env(LLMGW_ADMIN_ADDR=f"127.0.0.1:{self.admin_port}")
        self.admin = Process("admin-server", [sys.executable, "manage.py", "admin_server"], env, self.log_dir)
        wait_for_status(self.admin, self.admin_url + "/v1/models", 404, "the admin server")

    def start_gateway(self, i: int) -> None:
        env = self.env(
            LLMGW_GATEWAY_ADDR=f"127.0.0.1:{self.gateway_ports[i]}", LLMGW_GATEWAY_SPOOL=self.log_dir / "spool"
        )
        self.gateways[i] = Process(f"gateway-{i}", [sys.executable, "manage.py", "gateway"], env, self.log_dir)
        wait_for_status(self.gateways[i], self.gateway_urls[i] + "/v1/models", 401, f"gateway {i}")

    def processes(self) -> list[Process]:
        return [p for p in (self.byte_listener, self.worker, self.admin, *self.gateways) if p is not None]

    def stop(self) -> None:
        for process in self.processes():
            process.stop()
        self.proxy.stop()
        if self.redis is not None and self.redis.poll() is None:
            self.redis.kill()
            self.redis.wait(timeout=10)


class Node:
    """One node: its namespace, token, cache and (while it runs) its agent."""

    def __init__(self, name: str, host: Host, token: str, control: ControlPlane, log_dir: Path):
        self.name = name
        self.host = host
        self.token = token
        self.control = control
        self.cache = log_dir / f"cache-{name}"
        self.log_dir = log_dir
        self.agent: Process | None = None

    def env(self) -> dict:
        """deploy/env/node.env filled in for this node: the fleet's Redis and byte listener, its token and address."""
        return node_env(
            LLMGW_NODE_TOKEN=self.token,
            REDIS_URL=self.control.redis_url,
            LLMGW_BYTES_URL=self.control.bytes_url,
            LLMGW_VAR=self.log_dir / f"var-{self.name}",
            LLMGW_AGENT_CACHE=self.cache,
            # Engines listen on every address of the namespace (its bridge address is the
            # only one beside its own loopback) and replicas advertise the node's address.
            LLMGW_ENGINE_HOST="0.0.0.0",
            LLMGW_ENGINE_ADVERTISE=self.host.address,
            # The fleet test throttles and cuts the byte listener's HTTP (its proxy) and watches the
            # fetch's part files: its nodes fetch over HTTP. Their sharing of pieces over libtorrent,
            # in namespaces too, is tests/test_swarm_fleet.py's.
            LLMGW_FETCH_TORRENT="false" if self.control.whole else "true",
            LLMGW_HEARTBEAT_S=TIMING["LLMGW_HEARTBEAT_S"],
        )

    def start_agent(self) -> None:
        argv = [sys.executable, "manage.py", "agent", "--node", self.name, "--cache", str(self.cache)]
        self.agent = Process(f"agent-{self.name}", self.host.argv(argv), self.env(), self.log_dir)
        wait_until(
            lambda: "ready." in self.agent.output() or not self.agent.alive(), timeout=60, what=f"agent {self.name}"
        )
        assert self.agent.alive(), self.agent.output()

    def kill_agent(self) -> None:
        """The agent and its supervisor (its process group); engines run in their own sessions."""
        if self.agent is not None:
            self.agent.kill()
            self.agent.stop()

    def kill_everything(self) -> None:
        self.kill_agent()
        for pid in self.host.pids():
            try:
                import os

                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def engines(self) -> dict[int, str]:
        """{pid: served model name} of the engines running in this node's namespace."""
        found = {}
        for pid in self.host.pids():
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state == "Z" or not argv[0].endswith(b"llama-server"):
                continue
            args = [a.decode() for a in argv]
            found[pid] = args[args.index("--alias") + 1] if "--alias" in args else "?"
        return found

    def engine_log(self, replica_id: int) -> Path:
        return self.cache / "engines" / f"replica-{replica_id}.log"


def chat_requests_in(log: Path) -> int:
    """Requests an engine took into a slot, from its own log (llama-server's, in the replica's log)."""
    try:
        return len(re.findall(r"launch_slot_: id +\d+ \| task \d+ \| processing task", log.read_text(errors="replace")))
    except OSError:
        return 0


def endpoint_host(endpoint: str) -> str:
    return urlparse(endpoint).hostname or ""


class Asker:
    """A client that keeps asking through the gateways, the first that answers, and keeps every outcome."""

    def __init__(self, urls: list[str], key: str, body: dict):
        import threading

        self.urls = urls
        self.body = body
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"Bearer {key}"
        # (when it began, status, replica, detail); status 0: no gateway took it, -1: no answer in time
        self.outcomes: list[tuple[float, int, str, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def ask(self) -> tuple[int, str, str]:
        detail = ""
        for url in self.urls:
            try:
                r = self.session.post(url + "/v1/chat/completions", json=self.body, timeout=60)
            except requests.ConnectionError as error:
                detail = f"{url}: {error}"
                continue  # that gateway is down: the load balancer's next one
            except requests.RequestException as error:
                return -1, "", f"{url}: {error}"
            return r.status_code, r.headers.get("x-llmgw-replica", ""), r.text[:300] if r.status_code != 200 else ""
        return 0, "", detail

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            status, replica, detail = self.ask()
            self.outcomes.append((began, status, replica, detail))
            self._stop.wait(0.2)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=90)

    def failures(self, since: float = 0.0) -> list[tuple[float, int, str, str]]:
        """Requests begun at or after `since` (time.monotonic) that were not answered."""
        return [o for o in self.outcomes if o[1] != 200 and o[0] >= since]
