"""The tests' own servers (tests/services.py): what a run that cannot start leaves behind."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil


def _servers_under(directory: Path) -> list[str]:
    return [f"{p.pid}: {' '.join(p.info['cmdline'])[:200]}" for p in _processes_under(directory)]


def _processes_under(directory: Path) -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"]) if str(directory) in " ".join(p.info["cmdline"] or [])]


def _stop_servers_under(directory: Path) -> None:
    """What a failing run left (the old code's PostgreSQL) stopped, so that the failure leaks nothing."""
    for process in _processes_under(directory):
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


def test_a_run_that_finds_no_redis_server_leaves_no_postgresql_running_and_no_directory_behind(tmp_path, request):
    # Where the run makes its directories: one PostgreSQL's user (nobody, as root) can reach, as /tmp.
    temp = Path(tempfile.mkdtemp(prefix="llmgw-services-test-"))
    temp.chmod(0o755)
    request.addfinalizer(lambda: _stop_servers_under(temp) or shutil.rmtree(temp, ignore_errors=True))
    # As on a machine without Redis: every program on PATH but redis-server (PostgreSQL is found by its own path).
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for directory in reversed(os.environ["PATH"].split(os.pathsep)):
        for program in Path(directory).glob("*") if Path(directory).is_dir() else ():
            if program.name != "redis-server":
                (bin_dir / program.name).unlink(missing_ok=True)
                (bin_dir / program.name).symlink_to(program)
    env = {**os.environ, "PATH": str(bin_dir), "TMPDIR": str(temp)}
    env.pop("PYTEST_XDIST_WORKER", None)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--co", "-q", "tests/test_prefix_ring.py"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert run.returncode != 0 and "the tests need redis-server" in run.stderr + run.stdout, run.stdout + run.stderr
    assert _servers_under(temp) == []
    assert list(temp.iterdir()) == []
