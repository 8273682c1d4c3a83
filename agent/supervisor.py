"""The node's engine supervisor: keeps wanted engines running, outliving any one task.

A Celery task lasts as long as a fetch; an engine has to run for weeks. So the
task only records what it wants in a state file under the agent's cache
(`agent.engine_state`), and this supervisor — one process per node, started beside the agent's worker —
starts engines, health-checks them, restarts them after a crash with backoff,
stops them on request, and reports each change to the control plane.

The state file is also what survives the agent: engines run in their own
sessions, and a supervisor that starts finds in the file what its predecessor
started, adopts what is still running and wanted, and stops what is not.

This module is the process (`python -m agent.supervisor`, started by the agent command):
the loop over the replicas is agent/supervisor_loop.py, the liveness check agent/liveness.py.
"""

from __future__ import annotations

import argparse
import fcntl
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

import django
from django.conf import settings

from contracts import signing

from . import cache_evict, engine_state, engine_stats, fence, runtime
from .replica_reports import Report, celery_report
from .supervisor_loop import Supervisor

__all__ = ["Report", "Supervisor", "celery_report", "start"]


def start() -> subprocess.Popen:
    """Called by the agent command: the supervisor as a process of its own beside the worker.

    A process rather than a thread in the worker: Celery forks its pool, and a
    thread holding a lock at that moment would leave the children stuck on it.
    """
    env = dict(os.environ, LLMGW_NODE_TOKEN=runtime.token())
    argv = [sys.executable, "-m", "agent.supervisor", "--cache", str(runtime.cache_dir()), "--parent", str(os.getpid())]
    return subprocess.Popen(argv, env=env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Supervise this node's engines.")
    parser.add_argument("--cache", required=True, type=Path)
    parser.add_argument("--parent", type=int, default=0, help="exit when this process (the agent) is gone")
    options = parser.parse_args(argv)

    # Its environment holds the node's token and the broker's password (agent.fence); and the
    # capabilities LLMGW_ENGINE_USER needs stay in this process, passed to no engine it execs.
    fence.not_dumpable()
    fence.clear_ambient_capabilities()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "agent.settings")
    django.setup()
    import agent.celery  # noqa: F401  (the node's app, which reports are sent with)

    token = os.environ.get("LLMGW_NODE_TOKEN", "").strip()
    if not token:
        # Its engines' secrets are made from the token: without it they would answer anyone.
        print("LLMGW_NODE_TOKEN is not set: the supervisor needs the node's enrolment token", file=sys.stderr)
        return 1
    if problem := fence.engine_user_problem(settings.ENGINE_USER):
        print(problem, file=sys.stderr)
        return 1
    if not settings.ENGINE_USER:
        fence.drop_capabilities()
    single = _the_only_supervisor(options.cache)
    if single is None:
        print(f"another supervisor still runs the engines under {options.cache}", file=sys.stderr)
        return 1

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    if options.parent:
        threading.Thread(target=runtime.stop_with_parent, args=(options.parent, stop), daemon=True).start()
    supervisor = Supervisor(
        options.cache,
        celery_report(signing.token_hash(token)),
        host=settings.LLMGW_ENGINE_HOST,
        advertise=settings.LLMGW_ENGINE_ADVERTISE,
        allow_remote_code=settings.LLMGW_ALLOW_REMOTE_CODE,
        token=token,
        engine_user=settings.ENGINE_USER,
        rpc_listen=settings.LLMGW_ENGINE_ADVERTISE,
    )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s supervisor: %(message)s")
    _start_beside(supervisor, options.cache, stop)
    supervisor.run(stop)
    # Engines are left running on purpose: the next supervisor adopts them.
    return 0


def _the_only_supervisor(cache: Path) -> IO | None:
    """The lock that makes this the one supervisor of the cache (held while the file is open); None after 30 s.

    A restarted agent's new supervisor waits here for the old one to notice and go.
    """
    engine_state.state_dir(cache).mkdir(parents=True, exist_ok=True)
    single = open(engine_state.state_dir(cache) / "supervisor.lock", "a")
    deadline = time.monotonic() + 30
    while True:
        try:
            fcntl.flock(single, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return single
        except BlockingIOError:
            if time.monotonic() > deadline:
                single.close()
                return None
            time.sleep(0.5)


def _start_beside(supervisor: Supervisor, cache: Path, stop: threading.Event) -> None:
    """The threads that run beside the loop until `stop`."""
    # The engines' own count of their load (slots busy, requests deferred), for the control plane.
    reader = engine_stats.StatsReader(cache, runtime.node_name(), supervisor.key, host=supervisor.check_host)
    threading.Thread(target=reader.run, args=(stop,), name="engine-stats", daemon=True).start()
    # The node's disk: unused weights evicted above the cache's bounds, engine logs rotated.
    bounds = cache_evict.Bounds(
        settings.NODE_CACHE_MAX_GB * cache_evict.GiB, settings.NODE_CACHE_FREE_GB * cache_evict.GiB
    )
    threading.Thread(target=cache_evict.keep, args=(cache, bounds, stop), name="disk", daemon=True).start()


if __name__ == "__main__":
    sys.exit(main())
