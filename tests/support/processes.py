"""Real processes for the tests: the byte listener, Celery workers, and how to wait for them."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests
from django.conf import settings

from contracts.sources import SEED_ALIAS

from ..services import free_port
from .waiting import wait_until

BASE_DIR = Path(__file__).resolve().parents[2]


def test_database_url() -> str:
    """The test database (not the one it was named after) as a DATABASE_URL for child processes."""
    db = settings.DATABASES["default"]
    if db["ENGINE"] == "django.db.backends.sqlite3":
        return f"sqlite:///{db['NAME']}"
    return f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}"


ENV_FILES = BASE_DIR / "deploy" / "env"
# What a process needs from the machine it runs on, beside its env file.
MACHINE = ("PATH", "HOME")


def env_file(role: str) -> dict[str, str]:
    """deploy/env/<role>.env as written for an operator: {name: the example value}."""
    found = {}
    for line in (ENV_FILES / f"{role}.env").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, value = line.partition("=")
            found[name.strip()] = value.strip()
    return found


def _addr(addr: tuple[str, int]) -> str:
    return f"{addr[0]}:{addr[1]}"


def _fill(role: str) -> dict[str, str | None]:
    """The values this test session gives each variable the role's env file sets (None: left to its default).

    They are the test process's own settings, so a child agrees with the test about where
    the database, Redis, the mirror and the byte listener are.
    """
    if role == "control":
        return {
            "DJANGO_SECRET_KEY": settings.SECRET_KEY,
            "DJANGO_ALLOWED_HOSTS": ",".join(settings.ALLOWED_HOSTS),
            "DJANGO_CSRF_TRUSTED_ORIGINS": ",".join(settings.CSRF_TRUSTED_ORIGINS),
            "LLMGW_HTTPS": "false",
            "DATABASE_URL": test_database_url(),
            "REDIS_URL": settings.REDIS_URL,
            # The session's Redis has its default user (tests/test_redis_acl.py runs one with users).
            "LLMGW_REDIS_ACL": None,
            "LLMGW_BYTES_REDIS_URL": None,
            "LLMGW_VAR": os.environ["LLMGW_VAR"],
            "LLMGW_MIRROR_ROOT": os.environ["LLMGW_MIRROR_ROOT"],
            "LLMGW_ADMIN_ADDR": _addr(settings.ADMIN_ADDR),
            "LLMGW_ADMIN_WORKERS": "1",
            "LLMGW_BYTES_ADDR": _addr(settings.BYTES_ADDR),
            "LLMGW_BYTES_URL": settings.BYTES_URL,
            "LLMGW_BYTES_PUBLIC": "false",
            # One process's /metrics unless a test asks for the shared directory.
            "PROMETHEUS_MULTIPROC_DIR": None,
            # Scrapes from loopback or with a test's own token (tests/test_metrics_*.py).
            "LLMGW_METRICS_TOKEN": None,
        }
    if role == "node":
        return {
            # The node the test process is enrolled as (the `fleet_node` fixture's), if any;
            # a test that starts an agent of its own passes that node's token.
            "LLMGW_NODE_TOKEN": os.environ.get("LLMGW_NODE_TOKEN") or None,
            "REDIS_URL": settings.REDIS_URL,
            "LLMGW_REDIS_ACL": None,
            "LLMGW_BYTES_URL": settings.BYTES_URL,
            "LLMGW_VAR": os.environ["LLMGW_VAR"],
            "LLMGW_AGENT_CACHE": str(Path(os.environ["LLMGW_VAR"]) / "agent-cache"),
            # A test's node is this host: its engines listen on loopback and are reached there.
            "LLMGW_ENGINE_HOST": "127.0.0.1",
            "LLMGW_ENGINE_ADVERTISE": "127.0.0.1",
            # Its own peer port: several nodes of one test share this host.
            "LLMGW_PEER_PORT": str(free_port()),
            # Engines as the agent's own user, unless a test names one (tests/test_engine_fence.py).
            "LLMGW_ENGINE_USER": None,
            # The node's /metrics off unless a test serves it on a free port of its own.
            "LLMGW_AGENT_METRICS_ADDR": None,
            "LLMGW_AGENT_METRICS_TOKEN": None,
        }
    raise ValueError(f"no env file deploy/env/{role}.env for the tests to fill")


def role_env(role: str, **extra) -> dict:
    """The environment an operator gives a process of `role` (deploy/env/<role>.env), filled in for this test.

    Exactly the variables that file sets, with this session's values, plus PATH and HOME,
    plus `extra` (what the test needs): nothing else of the test process's environment,
    above all not its DJANGO_SETTINGS_MODULE or LLMGW_ROLE. A variable added to the file
    that the tests do not know how to fill stops here, rather than being left out unseen.
    """
    fill = _fill(role)
    unknown = set(env_file(role)) - set(fill)
    if unknown:
        raise AssertionError(f"deploy/env/{role}.env sets {sorted(unknown)}, which tests/processes.py does not fill")
    env = {name: os.environ[name] for name in MACHINE if name in os.environ}
    env.update({name: value for name, value in fill.items() if value is not None})
    env["PYTHONUNBUFFERED"] = "1"
    env.update({k: str(v) for k, v in extra.items()})
    return env


def process_env(**extra) -> dict:
    """A control-plane process's environment (deploy/env/control.env, filled in): admin, worker, byte listener, commands."""
    return role_env("control", **extra)


def node_env(**extra) -> dict:
    """A node's process's environment (deploy/env/node.env, filled in): `manage.py agent` and `manage.py fetch`."""
    node = {"LLMGW_NODE_NAME": os.environ["LLMGW_NODE_NAME"]} if os.environ.get("LLMGW_NODE_NAME") else {}
    return role_env("node", **{**node, **extra})


class Process:
    """A child process with its output kept in a file, stopped at the end of its fixture."""

    def __init__(self, name: str, argv: list[str], env: dict, log_dir: Path):
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "ab")
        self.popen = subprocess.Popen(
            argv, env=env, cwd=BASE_DIR, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.alive():
            os.killpg(self.popen.pid, sig)
        self.popen.wait(timeout=30)

    def stop(self) -> None:
        if self.alive():
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()
        self._log.close()


class AsNode:
    """`requests`, presenting the pass of the node in LLMGW_NODE_NAME and LLMGW_NODE_TOKEN (the `fleet_node` fixture's).

    The byte listener serves only the fleet's nodes; this is how a test reads it as one.
    """

    def __getattr__(self, method: str):
        def call(url: str, **kwargs):
            kwargs.setdefault("auth", node_pass())
            return getattr(requests, method)(url, **kwargs)

        return call


def node_pass():
    from agent.download import NodePass

    return NodePass(os.environ["LLMGW_NODE_NAME"], os.environ["LLMGW_NODE_TOKEN"])


as_node = AsNode()


def engine_secret(replica) -> dict[str, str]:
    """The header the gateway presents to this replica's engine (contracts.credentials), as a test asks it directly."""
    from contracts import credentials

    key = replica.node.token_hash if replica.node_id else ""
    return credentials.bearer(credentials.replica_secret(key, replica.pk, credentials.replica_nonce(replica.created)))


def ask_replica(replica) -> dict:
    """Eight tokens of the tiny model's chat, asked of the replica's engine directly with its
    secret, past the end-of-sequence token so the answer runs to its length."""
    from launcher.demo_model import EOS_TOKEN_ID

    answer = requests.post(
        replica.endpoint + "/chat/completions",
        headers=engine_secret(replica),
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 8,
            "logit_bias": {str(EOS_TOKEN_ID): -100},
        },
        timeout=60,
    ).json()
    assert answer["choices"][0]["finish_reason"] == "length", answer
    assert answer["usage"]["completion_tokens"] > 0, answer
    return answer


class NoAuth(requests.auth.AuthBase):
    """No credentials, not even ~/.netrc's."""

    def __call__(self, request):
        return request


def start_byte_listener(mirror_root: Path, log_dir: Path, **settings_env) -> tuple[Process, str]:
    port = free_port()
    env = process_env(
        LLMGW_MIRROR_ROOT=mirror_root, LLMGW_BYTES_ADDR=f"127.0.0.1:{port}", LLMGW_BYTES_WORKERS=1, **settings_env
    )
    process = Process("byte-listener", [sys.executable, "manage.py", "byte_listener"], env, log_dir)
    url = f"http://127.0.0.1:{port}/"
    # To a stranger, 401: the mirror serves only the fleet's nodes unless it is public.
    public = str(settings_env.get("LLMGW_BYTES_PUBLIC", "")).lower() in ("1", "true", "yes", "on")
    wait_for_status(process, url, 200 if public else 401, "the byte listener")
    return process, url


def wait_for_status(process: Process, url: str, status: int, what: str) -> None:
    """Until `url` answers `status` (to a request without credentials); the process's output if it exits first."""

    def answers():
        if not process.alive():
            raise AssertionError(f"{what} exited:\n{process.output()}")
        try:
            return requests.get(url, timeout=1, auth=NoAuth()).status_code == status
        except requests.RequestException:
            return False

    wait_until(answers, what=f"{what} to answer")


def start_celery_worker(name: str, queues: str, log_dir: Path, **env: str) -> Process:
    argv = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "llmgw_site",
        "worker",
        "-Q",
        queues,
        "-n",
        f"{name}@%h",
        "--concurrency",
        "2",
        "--pool",
        "prefork",
        "--loglevel",
        "INFO",
        "--without-gossip",
        "--without-mingle",
    ]
    process = Process(name, argv, process_env(**env), log_dir)
    wait_until(lambda: "ready." in process.output() or not process.alive(), timeout=30, what=f"{name} to start")
    if not process.alive():
        raise AssertionError(f"{name} exited:\n{process.output()}")
    return process


# The queues of the control plane's workers (deploy/systemd): llmgw-control takes placement, scans and
# what nodes report; llmgw-pulls takes pulls from other mirrors, which may take hours, on slots of their own.
CONTROL_QUEUE = "control"
PULLS_QUEUE = "pulls"


def start_pulls_worker(log_dir: Path, **env: str) -> Process:
    """The pulls worker (deploy/systemd/llmgw-pulls.service): `mirror.pull` alone, beside a control worker."""
    return start_celery_worker("pulls", PULLS_QUEUE, log_dir, **env)


def unaliased(path: str) -> str:
    """A byte listener's path as the file's own address: `/.seed/<n>/m/v1/a.bin` is `/m/v1/a.bin` (contracts.sources)."""
    return re.sub(rf"^/{re.escape(SEED_ALIAS)}/\d+/", "/", path)


class CountingProxy:
    """A loopback HTTP proxy in front of the byte listener that counts, slows and misbehaves.

    It counts the body bytes it passes on, so a test can assert what a resumed
    fetch transferred; it can send slowly, so "halfway" lasts long enough to be
    seen; and it can act out the servers a fetch must survive: one that ignores
    Range, one that cuts a body short, one that answers anything for a path.
    """

    def __init__(self, upstream: str, rate: int | None = None, host: str = "127.0.0.1"):
        import http.server
        import threading
        from urllib.parse import urlparse

        self.upstream = urlparse(upstream)
        self.rate = rate  # body bytes a second, for each request; None for as fast as it goes
        self.ignore_range = False
        self.truncate_after: int | None = None  # cut each GET body after this many bytes
        self.overrides: dict[str, tuple[int, str, bytes]] = {}  # path -> (status, content type, body)
        # (client address, path, Range header) -> True: the answer is held back, the connection kept
        # open with nothing sent, for as long as it says so (a source that stalls, issue 24).
        self.hold = None
        self.body_bytes = 0
        # Body bytes by file: by path, the query string dropped, and a seed alias's counted as its file's own
        # (`/.seed/3/m/v1/a.bin` is `/m/v1/a.bin`: a fetch asks for one file over several addresses).
        self.path_bytes: dict[str, int] = {}
        self.requests: list[tuple[str, str, str]] = []  # (method, path, Range header)
        # The tracker's, apart: a node's session announces what it holds by itself (after each `.complete`,
        # then every 5 s, agent/peers.py), at any moment of a test; `requests` is what fetches asked.
        self.announces: list[str] = []
        # Bytes of a request that began before reset_counts (say, to a process
        # just killed) are not counted after it.
        self._generation = 0
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_HEAD(self):
                proxy._relay(self, "HEAD")

            def do_GET(self):
                proxy._relay(self, "GET")

        # `host` is loopback but for the fleet test, whose nodes reach it on the test's own bridge.
        self.server = http.server.ThreadingHTTPServer((host, 0), Handler)
        self.server.daemon_threads = True
        # A fetch killed or cancelled mid-body drops its connection; that is the point, not an error.
        self.server.handle_error = lambda request, client_address: None
        self.url = f"http://{host}:{self.server.server_address[1]}/"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def _send_body(self, handler, data_iter, limit: int | None) -> None:
        generation = self._generation
        path = unaliased(handler.path.split("?", 1)[0])
        sent = 0
        started = time.monotonic()
        for chunk in data_iter:
            if limit is not None and sent + len(chunk) > limit:
                chunk = chunk[: limit - sent]
            if chunk:
                handler.wfile.write(chunk)
                handler.wfile.flush()
                sent += len(chunk)
                with self._lock:
                    if generation == self._generation:
                        self.body_bytes += len(chunk)
                        self.path_bytes[path] = self.path_bytes.get(path, 0) + len(chunk)
            if limit is not None and sent >= limit:
                break
            if self.rate:
                ahead = sent / self.rate - (time.monotonic() - started)
                if ahead > 0:
                    time.sleep(ahead)

    def _relay(self, handler, method: str) -> None:
        import http.client

        path = handler.path
        with self._lock:
            if path.startswith("/announce?"):
                self.announces.append(path)
            else:
                self.requests.append((method, path, handler.headers.get("Range", "")))
        while self.hold is not None and self.hold(handler.client_address[0], path, handler.headers.get("Range", "")):
            time.sleep(0.1)
        if path in self.overrides:
            status, content_type, body = self.overrides[path]
            handler.send_response(status)
            handler.send_header("Content-Type", content_type)
            handler.send_header("Content-Length", str(len(body)))
            handler.end_headers()
            if method == "GET":
                self._send_body(handler, [body], None)
            return
        headers = {}
        for name in ("Range", "If-Range", "Accept", "Authorization"):
            if handler.headers.get(name) and not (self.ignore_range and name in ("Range", "If-Range")):
                headers[name] = handler.headers[name]
        # As a proxy does: who asked, for a byte listener that trusts this proxy (LLMGW_BYTES_TRUSTED_PROXIES).
        headers["X-Forwarded-For"] = handler.client_address[0]
        conn = http.client.HTTPConnection(self.upstream.hostname, self.upstream.port, timeout=30)
        try:
            conn.request(method, path, headers=headers)
            response = conn.getresponse()
            handler.send_response(response.status)
            for name, value in response.getheaders():
                if name.lower() not in ("connection", "transfer-encoding", "keep-alive", "date", "server"):
                    handler.send_header(name, value)
            handler.send_header("Connection", "close")
            handler.end_headers()
            if method == "GET":
                chunk_size = 64 * 1024 if not self.rate else max(1024, self.rate // 20)
                self._send_body(handler, iter(lambda: response.read(chunk_size), b""), self.truncate_after)
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            conn.close()
            handler.close_connection = True

    def reset_counts(self) -> None:
        with self._lock:
            self.body_bytes = 0
            self.path_bytes = {}
            self.requests = []
            self.announces = []
            self._generation += 1

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def unreachable_database_url() -> str:
    """A PostgreSQL address where nothing listens: a node must work without a database."""
    return f"postgres://llmgw:llmgw@127.0.0.1:{free_port()}/llmgw"


def start_agent(node: str, token: str, cache: Path, log_dir: Path, **env: str) -> Process:
    """`manage.py agent --node NODE` as a node runs it: broker, byte listener and token, no database."""
    environment = node_env(LLMGW_NODE_TOKEN=token, LLMGW_HEARTBEAT_S=1, **env)
    argv = [sys.executable, "manage.py", "agent", "--node", node, "--cache", str(cache), "--labels", "zone=test"]
    process = Process(f"agent-{node}", argv, environment, log_dir)
    wait_until(lambda: "ready." in process.output() or not process.alive(), timeout=60, what=f"agent {node} to start")
    if not process.alive():
        raise AssertionError(f"agent {node} exited:\n{process.output()}")
    return process


def children_of(pid: int) -> list[int]:
    """The pool processes of a Celery worker, from /proc."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(p) for p in fh.read().split()]
    except OSError:
        return []


def start_admin_server(log_dir: Path, workers: int = 1, **settings_env) -> tuple[Process, str]:
    """`manage.py admin_server` (uvicorn: Django's pages) on a free port, on the test database.

    Ready when /v1/models answers 404: the admin port's word that the gateway is elsewhere
    (the gateway itself is tests/gateway_process.py's start_gateway).
    """
    port = free_port()
    env = process_env(LLMGW_ADMIN_ADDR=f"127.0.0.1:{port}", LLMGW_GATEWAY_REFRESH_MS=100, **settings_env)
    argv = [sys.executable, "manage.py", "admin_server"] + (["--workers", str(workers)] if workers != 1 else [])
    process = Process("admin-server", argv, env, log_dir)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_status(process, url + "/v1/models", 404, "the admin server")
    except AssertionError:
        process.stop()  # with --workers, a supervisor whose workers fail goes on starting them
        raise
    return process, url
