"""A pytest plugin, loaded before Django's settings: the tests' own Redis and var/.

Loaded with `-p tests.services` so that REDIS_URL and LLMGW_VAR are set before
pytest-django reads the settings. The tests start their own redis-server on a
free port, so they never touch a Redis somebody is using.
"""

import os
import shutil
import socket
import subprocess
import tempfile
import time

import pytest

_state: dict = {}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args):
    var = tempfile.mkdtemp(prefix="llmgw-test-")
    _state["var"] = var
    os.environ["LLMGW_VAR"] = var
    os.environ["LLMGW_MIRROR_ROOT"] = os.path.join(var, "mirror")
    # The tests make their own database and catalog; a developer's must not leak in.
    for name in ("DATABASE_URL", "LLMGW_CATALOG", "LLMGW_ADMIN_USER", "LLMGW_ADMIN_PASSWORD"):
        os.environ.pop(name, None)
    binary = shutil.which("redis-server")
    if binary is None:
        raise pytest.UsageError("the tests need redis-server: `make test` installs it, or apt-get install redis-server")
    port = free_port()
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", var],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    break
        except OSError:
            time.sleep(0.05)
    else:
        process.kill()
        raise pytest.UsageError("the tests' redis-server did not start")
    _state["redis"] = process
    os.environ["REDIS_URL"] = url


def pytest_unconfigure(config):
    process = _state.pop("redis", None)
    if process is not None:
        process.terminate()
        process.wait(timeout=10)
    var = _state.pop("var", None)
    if var and not os.environ.get("LLMGW_KEEP_TEST_VAR"):
        shutil.rmtree(var, ignore_errors=True)
