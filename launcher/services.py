"""Starting llmgw's processes on one machine, and stopping them cleanly."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import redis
from django.conf import settings
from django.contrib.auth import get_user_model

from contracts.redis_client import redis_client as pooled_client
from mirror import scan

from . import demo_model, smollm2

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", ""}


class StartError(Exception):
    """Something llmgw cannot start without; the message says what and how to fix it."""


def private_database() -> None:
    """The SQLite file of one machine made 0600 before its first connection, whatever the umask.

    It holds sessions, node token hashes (each node's signing key) and API key hashes, and
    SQLite makes its file 0644 under the usual umask; its WAL and shared memory take the
    file's mode. A file made before is left as it is.
    """
    db = settings.DATABASES["default"]
    if db["ENGINE"] != "django.db.backends.sqlite3":
        return
    path = Path(db["NAME"])
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
    except FileExistsError:
        pass


def redis_answers(url: str) -> bool:
    try:
        return bool(pooled_client(url, timeout=1).ping())
    except (redis.RedisError, OSError, ValueError):
        return False


def ensure_redis_server_installed() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    if os.geteuid() != 0:
        raise StartError(
            "redis-server is not installed and nothing answers at REDIS_URL. Install it with "
            "`sudo apt-get install redis-server`, or set REDIS_URL to a Redis that is running."
        )
    print("redis-server is not installed; installing Debian's package…", flush=True)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-qq"], check=False, env=env)
    done = subprocess.run(["apt-get", "install", "-y", "-qq", "redis-server"], env=env)
    found = shutil.which("redis-server")
    if done.returncode != 0 or not found:
        raise StartError("installing redis-server with apt-get failed; its output above says why.")
    return found


def start_private_redis(
    url: str, data_dir: Path, aclfile: Path | None = None, answers_url: str = ""
) -> subprocess.Popen:
    """A redis-server of our own on the port REDIS_URL names, with its data under var/.

    With `aclfile`, each principal its own user (fleet/redis_acl.py) and no default user:
    `answers_url` is who asks whether it is up.
    """
    parsed = urlparse(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 6379
    if host not in LOCAL_HOSTS:
        raise StartError(f"nothing answers at REDIS_URL ({url}), and it is not on this machine to start.")
    binary = ensure_redis_server_installed()
    data_dir.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(data_dir),
            "--save",
            "60",
            "1",
            "--appendonly",
            "no",
            "--protected-mode",
            "yes",
            *(["--aclfile", str(aclfile)] if aclfile else []),
        ],
        stdout=open(data_dir / "redis.log", "ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        # What Redis writes (the users file at each ACL SAVE, its snapshot of limits and progress)
        # is made 0600: Redis creates its files 0644 under the usual umask.
        umask=0o077,
    )
    for _ in range(50):
        if redis_answers(answers_url or url):
            return process
        if process.poll() is not None:
            break
        time.sleep(0.1)
    process.terminate()
    raise StartError(f"redis-server did not start on port {port}; {data_dir / 'redis.log'} says why.")


def address_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def check_addresses(addresses: dict[str, tuple[str, int]]) -> None:
    """Refuse to start when a listening address is taken, naming the setting that chose it.

    Said before anything starts: otherwise the server retries, gives up, and the
    user sees five "Connection in use" lines and a stop they have to read back from.
    """
    for setting, (host, port) in addresses.items():
        if address_in_use(host, port):
            raise StartError(
                f"{host}:{port} ({setting}) is already in use: stop what listens there, "
                f"or set {setting} to another address."
            )


def ensure_staff_user() -> str | None:
    """The staff account: from LLMGW_ADMIN_USER/LLMGW_ADMIN_PASSWORD, or made once and printed."""
    User = get_user_model()
    username = os.environ.get("LLMGW_ADMIN_USER", "").strip()
    password = os.environ.get("LLMGW_ADMIN_PASSWORD", "")
    if username:
        user, _ = User.objects.get_or_create(username=username)
        user.is_staff = user.is_superuser = True
        if password:
            user.set_password(password)
        user.save()
        return None
    if User.objects.filter(is_superuser=True).exists():
        return None
    password = secrets.token_urlsafe(12)
    User.objects.create_superuser("admin", "", password)
    return f"Created the staff account admin with password {password} (shown this once)."


def ensure_demo_model() -> str | None:
    """The demo model in the mirror and in its index; a sentence saying where, or None when turned off.

    Indexed at once rather than at the next scan, so that the admin shows it as
    soon as `make run` says llmgw is up.
    """
    if not settings.DEMO_MODEL:
        return None
    where = Path(settings.MIRROR_ROOT) / demo_model.DEMO_MODEL
    try:
        written = demo_model.seed_mirror(Path(settings.MIRROR_ROOT))
    except OSError as error:
        # A demo is not worth refusing to start over (a full disk, say).
        return f"Demo model: could not write it to {where} ({error}); llmgw runs without it."
    scan.scan_mirror()
    if written is None:
        return f"Demo model: {where} was there already, so it is left as it is."
    return f"Demo model (random weights): written to {written}; serve it from the admin's Mirror versions."


def ensure_real_demo_model() -> str | None:
    """SmolLM2-135M-Instruct in the mirror beside tiny-demo; a sentence saying where, or None when turned off."""
    if not settings.DEMO_MODEL:
        return None
    where = Path(settings.MIRROR_ROOT) / smollm2.MODEL
    try:
        written = smollm2.seed_mirror(Path(settings.MIRROR_ROOT))
    except (OSError, smollm2.DemoModelError, subprocess.SubprocessError) as error:
        # No registry to reach, a full disk: the demo is not worth refusing to start over.
        return f"Demo model {smollm2.MODEL}: could not write it to {where} ({error}); llmgw runs without it."
    scan.scan_mirror()
    if written is None:
        return f"Demo model {smollm2.MODEL}: {where} was there already, so it is left as it is."
    return (
        f"Demo model SmolLM2-135M-Instruct (a real one, answers in English): written to {written}; "
        "serve it from the admin's Mirror versions."
    )


@dataclass
class Service:
    name: str
    argv: list[str]
    env: dict | None = None
    process: subprocess.Popen | None = None


class ProcessGroup:
    """Starts services in order and stops them in reverse; one that dies stops the rest."""

    def __init__(self) -> None:
        self.services: list[Service] = []
        self.stopping = False

    def adopt(self, name: str, process: subprocess.Popen) -> None:
        self.services.append(Service(name, [], process=process))

    def start(self, name: str, argv: list[str], env: dict | None = None) -> None:
        service = Service(name, argv, env)
        # Own session: Ctrl-C reaches us alone, and we stop each service in turn.
        service.process = subprocess.Popen(argv, env=env, start_new_session=True, cwd=settings.BASE_DIR)
        self.services.append(service)

    def wait(self) -> int:
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        while not self.stopping:
            for service in self.services:
                code = service.process.poll()
                if code is not None:
                    print(f"\n{service.name} stopped unexpectedly (exit {code}); stopping the rest.", flush=True)
                    self.stop()
                    return 1
            time.sleep(0.5)
        self.stop()
        return 0

    def _on_signal(self, signum, frame) -> None:
        self.stopping = True

    def stop(self) -> None:
        for service in reversed(self.services):
            if service.process.poll() is None:
                service.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for service in reversed(self.services):
            remaining = max(0.1, deadline - time.monotonic())
            try:
                service.process.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                print(f"{service.name} did not stop in time; killing it.", flush=True)
                os.killpg(service.process.pid, signal.SIGKILL)
                service.process.wait()
