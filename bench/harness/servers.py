"""The processes a benchmark run starts, on loopback, and their stop however the run ends."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def until(condition: Callable[[], T], timeout: float, what: str, interval: float = 0.01) -> T:
    """`condition()`'s first true value, asked every `interval` seconds; a sentence if it never comes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(interval)
    raise SystemExit(f"timed out waiting for {what}")


def wait_for(url: str, timeout: float = 60) -> None:
    """Until a HEAD of the address succeeds; a HEAD, so a 2 GiB file is not read to ask."""

    def answers() -> bool:
        return subprocess.run(["curl", "-sfI", "-o", "/dev/null", url]).returncode == 0

    until(answers, timeout, f"{url} to answer", 0.2)


class Servers:
    """A run's work directory and the processes it starts (each in a session of its own, logged to
    `<work>/<name>.log`); on leaving, every one is stopped, last started first, and the directory
    removed unless `keep`. A SIGTERM to the run leaves the same way."""

    def __init__(self, prefix: str = "llmgw-bench-", keep: bool = False) -> None:
        self.work = Path(tempfile.mkdtemp(prefix=prefix))
        self.keep = keep
        self.processes: list[subprocess.Popen] = []

    def __enter__(self) -> Servers:
        self._sigterm = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        return self

    def __exit__(self, *_) -> None:
        signal.signal(signal.SIGTERM, self._sigterm)
        self.stop_all()
        if self.keep:
            print(f"work directory kept: {self.work}")
        else:
            shutil.rmtree(self.work, ignore_errors=True)

    def spawn(self, argv: list[str], name: str, env: dict | None = None, cwd: Path = ROOT) -> subprocess.Popen:
        log = (self.work / f"{name}.log").open("ab")
        process = subprocess.Popen(
            argv,
            env=env if env is not None else dict(os.environ),
            cwd=cwd,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.processes.append(process)
        return process

    def adopt(self, process: subprocess.Popen) -> subprocess.Popen:
        """A process started elsewhere (in a session of its own), stopped with the others."""
        self.processes.append(process)
        return process

    def log_tail(self, name: str, size: int = 2000) -> str:
        log = self.work / f"{name}.log"
        return log.read_text(errors="replace")[-size:] if log.exists() else ""

    @staticmethod
    def stop(process: subprocess.Popen, grace: float = 15) -> None:
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=grace)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()

    def stop_all(self) -> None:
        for process in reversed(self.processes):
            self.stop(process)
        self.processes.clear()

    # --- the servers several benchmarks start -----------------------------------------------

    def redis(self, name: str = "redis") -> tuple[subprocess.Popen, int]:
        """A Redis of the run's own, nothing saved."""
        port = free_port()
        argv = ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no", "--dir", str(self.work)]
        return self.spawn(argv, name), port

    def stub(self) -> tuple[subprocess.Popen, int]:
        """bench/stub_upstream.py: an OpenAI-shaped upstream that answers at once."""
        port = free_port()
        argv = [sys.executable, str(ROOT / "bench" / "stub_upstream.py"), "--port", str(port)]
        return self.spawn(argv, "stub"), port

    def byte_listener(self, root: Path, name: str = "bytes", redis_url: str = "") -> tuple[subprocess.Popen, str]:
        """`manage.py byte_listener` serving `root` on a free port, its own var/ and database in the work
        directory, migrated; a Redis of its own unless `redis_url` names one (a manifest's copy is kept there)."""
        if not redis_url:
            redis_url = f"redis://127.0.0.1:{self.redis(f'{name}-redis')[1]}/0"
        port = free_port()
        env = dict(
            os.environ,
            REDIS_URL=redis_url,
            LLMGW_MIRROR_ROOT=str(root),
            LLMGW_BYTES_ADDR=f"127.0.0.1:{port}",
            LLMGW_VAR=str(self.work / "var"),
            DATABASE_URL=f"sqlite:///{self.work / 'bench.sqlite3'}",
            # Public: curl and aria2c have no node's pass. A pass costs one indexed query per
            # request, not per byte, so the throughput of a file is the same (docs/mirror.md).
            LLMGW_BYTES_PUBLIC="true",
        )
        # Migrated: a version's manifest is offered once its files are in the index with their sha256.
        manage = [sys.executable, str(ROOT / "manage.py")]
        subprocess.run(manage + ["migrate", "-v", "0"], env=env, cwd=ROOT, check=True)
        process = self.spawn(manage + ["byte_listener"], name, env)
        return process, f"http://127.0.0.1:{port}/"
