"""What the benchmarks share: a free port, waiting for a server, and a byte listener to measure."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(url: str, timeout: float = 30) -> None:
    """Until a HEAD of the address succeeds; a HEAD, so a 2 GiB file is not read to ask."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if subprocess.run(["curl", "-sfI", "-o", "/dev/null", url]).returncode == 0:
            return
        time.sleep(0.2)
    raise SystemExit(f"{url} did not answer within {timeout}s")


def start_byte_listener(root: Path, work: Path) -> tuple[subprocess.Popen, str]:
    """`manage.py byte_listener` serving `root` on a free port, its own var/ and database under `work`."""
    port = free_port()
    env = dict(
        os.environ,
        LLMGW_MIRROR_ROOT=str(root),
        LLMGW_BYTES_ADDR=f"127.0.0.1:{port}",
        LLMGW_VAR=str(work / "var"),
        DATABASE_URL=f"sqlite:///{work / 'bench.sqlite3'}",
        # Public: curl and aria2c have no node's pass. A pass costs one indexed query per
        # request, not per byte, so the throughput of a file is the same (docs/mirror.md).
        LLMGW_BYTES_PUBLIC="true",
    )
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "manage.py"), "byte_listener"],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    return process, f"http://127.0.0.1:{port}/"
