"""Real processes for the tests: the byte listener, Celery workers, and how to wait for them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests
from django.conf import settings

from .services import free_port

BASE_DIR = Path(__file__).resolve().parent.parent


def test_database_url() -> str:
    name = settings.DATABASES["default"]["NAME"]
    return f"sqlite:///{name}"


def process_env(**extra: str) -> dict:
    env = dict(os.environ)
    env["DATABASE_URL"] = test_database_url()
    env["PYTHONUNBUFFERED"] = "1"
    env.update({k: str(v) for k, v in extra.items()})
    return env


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


def wait_until(condition, timeout: float = 20.0, interval: float = 0.1, what: str = "the condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = condition()
        if result:
            return result
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def start_byte_listener(mirror_root: Path, log_dir: Path, **settings_env) -> tuple[Process, str]:
    port = free_port()
    env = process_env(
        LLMGW_MIRROR_ROOT=mirror_root, LLMGW_BYTES_ADDR=f"127.0.0.1:{port}", LLMGW_BYTES_WORKERS=1, **settings_env
    )
    process = Process("byte-listener", [sys.executable, "manage.py", "byte_listener"], env, log_dir)
    url = f"http://127.0.0.1:{port}/"

    def answers():
        if not process.alive():
            raise AssertionError(f"the byte listener exited:\n{process.output()}")
        try:
            return requests.get(url, timeout=1).status_code == 200
        except requests.RequestException:
            return False

    wait_until(answers, what="the byte listener to answer")
    return process, url


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
