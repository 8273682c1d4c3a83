"""The gateway as its own process (`manage.py gateway`), and the tests' databases stopped under it.

Kept apart from tests/processes.py: the gateway's process, its outages and the
servers it outlives are this module's.
"""

from __future__ import annotations

import os
import pwd
import signal
import subprocess
import sys
from pathlib import Path

import requests

from .. import services
from ..fake_replica import STEERING_KEYS
from ..services import free_port
from .processes import Process, process_env, wait_until


def start_gateway(
    log_dir: Path, workers: int = 1, name: str = "gateway", wait_status: int = 401, **settings_env
) -> tuple[Process, str]:
    """`manage.py gateway` (uvicorn: /v1/ alone) on a free port, on the test database, refreshing every 100 ms.

    Ready when GET /v1/models without a key answers `wait_status`: 401 once it has read its
    table, 503 while it cannot read one.
    """
    port = free_port()
    settings_env.setdefault("LLMGW_GATEWAY_SPOOL", log_dir / f"{name}-spool")
    # The fake replica's steering keys are its engine keys, allowed as an operator allows an engine's.
    settings_env.setdefault("LLMGW_GATEWAY_ENGINE_KEYS", ",".join(STEERING_KEYS))
    env = process_env(LLMGW_GATEWAY_ADDR=f"127.0.0.1:{port}", LLMGW_GATEWAY_REFRESH_MS=100, **settings_env)
    argv = [sys.executable, "manage.py", "gateway"] + (["--workers", str(workers)] if workers != 1 else [])
    process = Process(name, argv, env, log_dir)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_answer(process, url + "/v1/models", wait_status, name)
    except AssertionError:
        process.stop()  # with --workers, a supervisor whose workers fail goes on starting them
        raise
    return process, url


def wait_for_answer(process: Process, url: str, status: int, what: str) -> None:
    def answers():
        if not process.alive():
            raise AssertionError(f"{what} exited:\n{process.output()}")
        try:
            return requests.get(url, timeout=1).status_code == status
        except requests.RequestException:
            return False

    wait_until(answers, timeout=30, what=f"{what} to answer {status} at {url}")


# --- the tests' own PostgreSQL and Redis, stopped and started again ------------------------


def _restart(name: str) -> subprocess.Popen:
    old: subprocess.Popen = services._state[name]
    run_as: dict = {}
    if name == "postgres" and os.geteuid() == 0:
        user = pwd.getpwnam("nobody")
        run_as = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
    cwd = services._state.get("pg_home") if name == "postgres" else None
    log = open(os.path.join(cwd, "postgres.log"), "ab") if cwd else subprocess.DEVNULL
    process = subprocess.Popen(old.args, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, **run_as)
    services._state[name] = process
    return process


def stop_postgres() -> None:
    """The tests' PostgreSQL stopped (fast shutdown: every session ended), its data kept for start_postgres."""
    from django.db import connections

    for connection in connections.all():
        connection.close()
    process: subprocess.Popen = services._state["postgres"]
    process.send_signal(signal.SIGINT)
    process.wait(timeout=30)


def start_postgres() -> None:
    """The tests' PostgreSQL again, on its port and data; until it takes connections."""
    import psycopg
    from django.conf import settings

    process = _restart("postgres")
    db = settings.DATABASES["default"]

    def accepts() -> bool:
        if process.poll() is not None:
            raise AssertionError("the tests' PostgreSQL did not start again; postgres.log says why")
        try:
            psycopg.connect(host=db["HOST"], port=db["PORT"], user=db["USER"], dbname=db["NAME"]).close()
            return True
        except psycopg.OperationalError:
            return False

    wait_until(accepts, timeout=30, what="the tests' PostgreSQL to take connections again")


def stop_redis() -> None:
    process: subprocess.Popen = services._state["redis"]
    process.terminate()
    process.wait(timeout=30)


def start_redis() -> None:
    import redis
    from django.conf import settings

    process = _restart("redis")

    def answers() -> bool:
        if process.poll() is not None:
            raise AssertionError("the tests' Redis did not start again")
        try:
            return bool(redis.Redis.from_url(settings.REDIS_URL, socket_timeout=1).ping())
        except (redis.RedisError, OSError):
            return False

    wait_until(answers, timeout=30, what="the tests' Redis to answer again")
