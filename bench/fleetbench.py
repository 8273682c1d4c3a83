"""A whole small fleet on this machine, for the benches that measure it end to end.

A Redis, a SQLite database, the byte listener, a control worker (Celery, queue
`control`), the beat (`celery beat`, fleet.reconcile every LLMGW_RECONCILE_INTERVAL_S,
5 s by default), one agent (`manage.py agent`, node n1, with its engine supervisor) and
gateways (`manage.py gateway`: /v1/ alone), each its own
process as in production; SmolLM2-135M-Instruct Q4_1 (launcher/smollm2.py) in the
mirror. Only loopback. Used by bench/wake.py and bench/on_demand_change.py.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import ROOT, Servers, free_port, until  # noqa: E402

sys.path.insert(0, str(ROOT))

__all__ = ["MODEL", "LocalFleet", "until"]

MODEL = "smollm2-135m"


class LocalFleet:
    """Start with `with LocalFleet(prefix) as fleet:`; Django is set up on its database inside.
    Its work directory, with every process's log, is kept."""

    def __init__(self, prefix: str, beat: bool = True) -> None:
        self.servers = Servers(prefix, keep=True)
        self.work = self.servers.work
        self.cache = self.work / "cache"
        self.beat = beat

    def spawn(self, argv: list[str], name: str, **env):
        return self.servers.spawn(argv, name, dict(os.environ, **{k: str(v) for k, v in env.items()}))

    def __enter__(self) -> LocalFleet:
        self.servers.__enter__()
        try:
            self._start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _start(self) -> None:
        _, redis_port = self.servers.redis()
        os.environ.update(
            REDIS_URL=f"redis://127.0.0.1:{redis_port}/0",
            LLMGW_VAR=str(self.work / "var"),
            LLMGW_MIRROR_ROOT=str(self.work / "mirror"),
            DATABASE_URL=f"sqlite:///{self.work / 'bench.sqlite3'}",
            DJANGO_SETTINGS_MODULE="llmgw_site.settings",
            PYTHONUNBUFFERED="1",
        )
        import django

        django.setup()
        from django.core.management import call_command

        from fleet.enrolment import issue_token
        from fleet.models import Node
        from launcher import smollm2

        call_command("migrate", verbosity=0)
        self.weights = smollm2.gguf_path()
        version = self.work / "mirror" / MODEL / "instruct-q4_1"
        version.mkdir(parents=True)
        shutil.copyfile(self.weights, version / self.weights.name)
        self.bytes_url = self.servers.byte_listener(self.work / "mirror", redis_url=os.environ["REDIS_URL"])[1]
        self.source = f"{self.bytes_url}{MODEL}/instruct-q4_1/{self.weights.name}"
        python = sys.executable
        self.spawn([python, "-m", "celery", "-A", "llmgw_site", "worker", "-Q", "control", "-c", "2"], "control")
        if self.beat:
            schedule = self.work / "beat-schedule"
            self.spawn([python, "-m", "celery", "-A", "llmgw_site", "beat", "-s", str(schedule)], "beat")
        self.spawn(
            [python, "manage.py", "agent", "--node", "n1", "--cache", str(self.cache)],
            "agent",
            LLMGW_NODE_TOKEN=issue_token("n1"),
            LLMGW_BYTES_URL=self.bytes_url,
            LLMGW_HEARTBEAT_S="1",
        )
        until(
            lambda: (n := Node.objects.filter(name="n1").first()) and n.state == "ready" and "llamacpp" in n.engines,
            180,
            "the agent's heartbeat",
            0.2,
        )

    def gateway(self, name: str = "gateway", **env) -> str:
        """A gateway (`manage.py gateway`, one uvicorn worker) on a free port; its /v1/ address."""
        port = free_port()
        self.spawn([sys.executable, "manage.py", "gateway"], name, LLMGW_GATEWAY_ADDR=f"127.0.0.1:{port}", **env)
        url = f"http://127.0.0.1:{port}"

        def answers():
            try:
                import requests

                return requests.get(url + "/v1/models", timeout=2).status_code == 401
            except requests.RequestException:
                return False

        until(answers, 60, f"the gateway {name}", 0.2)
        return url

    def engine_pid(self, replica_id: int) -> int | None:
        from agent import engine_state

        entry = engine_state.read_state(self.cache)["replicas"].get(str(replica_id)) or {}
        return entry.get("pid")

    def __exit__(self, *_) -> None:
        from agent import engine_state, engines

        if self.cache.exists():
            for entry in engine_state.read_state(self.cache)["replicas"].values():
                if entry.get("pid") and engines.group_alive(entry["pid"]):
                    engines.stop_group(entry["pid"], grace=3)
        self.servers.__exit__()
