"""Two control-plane hosts, A and B, in network namespaces: one scheduler at a time, and B goes on when A is lost.

Each host runs what deploy/systemd runs on a control host: the admin server, the control
worker and the scheduler (`celery beat`, llmgw-beat.service), all with the fleet's Redis
and PostgreSQL (its socket: a database host of its own, as far as the namespaces go). A
node in a third namespace runs the tiny model's engines. The test:

1. while both hosts run, only one scheduler sends the periodic tasks: no task is sent
   twice in one tick (two plain beats, the old way, each send every one);
2. A's processes are SIGKILLed, as a host that is lost (in the middle of a reconcile pass,
   its lock left in Redis); B's scheduler takes the lease
   once A's lapses, its mirror scan finds a version copied in after A died, and a model
   of that version served through B's admin gets its replica placed and ready on the node.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys
import time
from datetime import datetime
from itertools import pairwise
from pathlib import Path
from urllib.parse import quote

import pytest
import redis

from . import netns

if reason := netns.unavailable():
    pytest.skip(reason, allow_module_level=True)

from django.conf import settings  # noqa: E402

from fleet import reconcile  # noqa: E402
from fleet.enrolment import issue_token  # noqa: E402
from fleet.models import Replica  # noqa: E402
from launcher.demo_model import write_tiny_llama  # noqa: E402

from . import services  # noqa: E402
from .fleet_netns import TIMING, ControlPlane, Node, free_port_on  # noqa: E402
from .staff_api import token_session  # noqa: E402
from .support.database import db_access  # noqa: E402, F401  (a fixture)
from .support.mirror import settle  # noqa: E402
from .support.processes import Process, wait_for_status  # noqa: E402
from .support.waiting import wait_until  # noqa: E402

pytestmark = pytest.mark.engine

# Short, so that B takes over in seconds: the lease lapses 4 s after A's last renewal.
LEASE_S = 4
RECONCILE_S = int(TIMING["LLMGW_RECONCILE_INTERVAL_S"])  # fleet_netns's short timings
SENT = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+): INFO/MainProcess\] Scheduler: Sending due task (\S+)")


def database_url_over_socket() -> str:
    """The test database by PostgreSQL's Unix socket: the namespaces share the file system, not loopback."""
    db = settings.DATABASES["default"]
    home = services._state.get("pg_home")
    if db["ENGINE"] == "django.db.backends.sqlite3" or not home:
        pytest.skip("two control hosts share a PostgreSQL server (LLMGW_TEST_DATABASE=postgres)")
    return f"postgres://{db['USER']}@{quote(home, safe='')}:{db['PORT']}/{db['NAME']}"


class FetchingNode(Node):
    """A node that fetches over HTTP from the byte listener (the control plane here is Redis and the mirror only)."""

    def env(self) -> dict:
        return super().env() | {"LLMGW_FETCH_TORRENT": "false"}


class ControlHost:
    """Control host LABEL in its namespace: admin server, control worker and scheduler, as deploy/systemd has them."""

    def __init__(self, label: str, host: netns.Host, fleet: ControlPlane, log_dir: Path, database_url: str):
        self.label = label
        self.host = host
        self.admin_port = free_port_on(fleet.fleet.address)
        self.admin_url = f"http://{host.address}:{self.admin_port}"
        self.env = fleet.env(
            DATABASE_URL=database_url,
            LLMGW_VAR=log_dir / f"var-{label}",
            LLMGW_ADMIN_ADDR=f"{host.address}:{self.admin_port}",
            DJANGO_ALLOWED_HOSTS=host.address,
            LLMGW_BEAT_LEASE_S=LEASE_S,
        )
        self.log_dir = log_dir
        self.processes: list[Process] = []

    def start(self, name: str, argv: list[str]) -> Process:
        process = Process(f"{self.label}-{name}", self.host.argv(argv), self.env, self.log_dir)
        self.processes.append(process)
        return process

    def start_all(self) -> None:
        py = sys.executable
        self.admin = self.start("admin", [py, "manage.py", "admin_server"])
        celery = [py, "-m", "celery", "-A", "llmgw_site"]
        self.worker = self.start(
            "worker",
            celery
            + ["worker", "-Q", "control", "-n", f"control@{self.label}", "--concurrency", "2", "--loglevel", "INFO"],
        )
        # A schedule file of its own: the old way, each host's beat kept its own and sent every task.
        schedule = str(self.log_dir / f"beat-schedule-{self.label}")
        self.beat = self.start("beat", celery + ["beat", "--loglevel", "INFO", "--schedule", schedule])
        wait_for_status(self.admin, self.admin_url + "/v1/models", 404, f"host {self.label}'s admin server")
        wait_until(
            lambda: "ready." in self.worker.output() or not self.worker.alive(),
            timeout=60,
            what=f"host {self.label}'s control worker",
        )
        assert self.worker.alive(), self.worker.output()

    def kill(self) -> None:
        """Every process of the host at once, SIGKILL: the host lost, nothing given back."""
        for pid in self.host.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for process in self.processes:
            process.kill()

    def stop(self) -> None:
        for process in self.processes:
            process.stop()


def sends(beat: Process) -> list[tuple[float, str]]:
    """(when, entry) of every periodic task this scheduler sent, from its log."""
    found = []
    for stamp, entry in SENT.findall(beat.output()):
        found.append((datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp(), entry))
    return found


@pytest.fixture(scope="module")
def hosts(db_access, tmp_path_factory):  # noqa: F811  (the fixture imported above)
    log_dir = tmp_path_factory.mktemp("two-control-hosts")
    network = netns.Fleet()
    fleet = None
    started: list = []
    try:
        mirror = log_dir / "mirror"
        write_tiny_llama(log_dir / "gguf")
        (mirror / "tiny" / "v1").mkdir(parents=True)
        for part in (log_dir / "gguf").glob("*.gguf"):
            shutil.copyfile(part, mirror / "tiny" / "v1" / part.name)
        settle(mirror)
        # Redis and the byte listener on this host's end of the bridge: the fleet's, not either control host's.
        fleet = ControlPlane(network, mirror, log_dir, whole=False)
        database_url = database_url_over_socket()
        a = ControlHost("A", network.add_host("ctl-a"), fleet, log_dir, database_url)
        b = ControlHost("B", network.add_host("ctl-b"), fleet, log_dir, database_url)
        started += [a, b]
        a.start_all()
        # A's scheduler first (it holds the lease, or on a scheduler without one has begun sending), then B's.
        wait_until(
            lambda: "Acquired lock" in a.beat.output() or sends(a.beat), timeout=30, what="A's scheduler to begin"
        )
        b.start_all()
        node_host = network.add_host("n1")
        node = FetchingNode("n1", node_host, issue_token("n1", address=node_host.address), fleet, log_dir)
        started.append(node)
        node.start_agent()
        yield a, b, node, mirror, log_dir, fleet
    finally:
        for thing in started:
            if isinstance(thing, Node):
                thing.kill_everything()
            else:
                thing.stop()
        if fleet is not None:
            fleet.stop()
        network.remove()


def test_while_both_hosts_run_one_scheduler_sends_each_periodic_task_once_a_tick(hosts):
    a, b, _, _, _, _ = hosts
    b_started = time.time()
    # A few of A's ticks with B's scheduler up beside it.
    wait_until(
        lambda: sum(1 for at, entry in sends(a.beat) if entry == "fleet-reconcile" and at > b_started + 1) >= 4,
        timeout=30,
        what=lambda: f"A's scheduler to send fleet-reconcile 4 times with B up:\n{a.beat.output()[-2000:]}",
    )
    assert b.beat.alive(), b.beat.output()
    assert sends(b.beat) == [], f"B's scheduler sent tasks while A held the lease:\n{b.beat.output()[-3000:]}"
    assert "Acquired lock" not in b.beat.output()
    # And between them, each entry once per interval, never two in one tick.
    reconciles = sorted(at for at, entry in sends(a.beat) + sends(b.beat) if entry == "fleet-reconcile")
    gaps = [later - earlier for earlier, later in pairwise(reconciles)]
    assert all(gap > RECONCILE_S / 2 for gap in gaps), f"fleet-reconcile sent twice in one tick: gaps {gaps}"


def test_host_a_killed_host_b_takes_the_lease_and_places_a_new_models_replica(hosts):
    a, b, node, mirror, log_dir, fleet = hosts
    a.kill()
    killed = time.monotonic()
    # Killed in the middle of a reconcile pass, as a lost host may well be: its Redis lock stays until it expires.
    redis.Redis.from_url(fleet.redis_url).set(
        reconcile.LOCK_NAME, "a pass of host A", px=reconcile.LOCK_TIMEOUT_S * 1000, nx=True
    )
    # A version only a scan after A died can find: B's scheduler must send mirror-scan.
    (mirror / "tiny" / "v2").mkdir()
    for part in (log_dir / "gguf").glob("*.gguf"):
        shutil.copyfile(part, mirror / "tiny" / "v2" / part.name)
    settle(mirror / "tiny" / "v2")

    wait_until(
        lambda: "Acquired lock" in b.beat.output(),
        timeout=LEASE_S + 20,
        what=lambda: f"B's scheduler to take the lease after A was lost:\n{b.beat.output()[-2000:]}",
    )
    api = token_session()
    plan = wait_until(
        lambda: (r := api.get(b.admin_url + "/api/serve/plan/?model=tiny&version=v2", timeout=5)).ok and r.json(),
        timeout=60 - (time.monotonic() - killed),
        what="B's scheduler's mirror scan to find tiny/v2",
    )
    body = {"name": "after-a", "source": plan["source"], "engine": plan["engine"], "profile": plan["profile"]}
    body |= {"context_length": 256, "ctx_size": 256, "replicas": 1, "min_memory_gb": plan["min_memory_gb"]}
    served = api.post(b.admin_url + "/api/serve/", json=body, timeout=10)
    assert served.status_code == 201, served.text

    def state() -> str:
        rows = Replica.objects.filter(model_name="after-a").values_list("node__name", "state", "reason")
        return f"replicas {list(rows)}; B's worker:\n{b.worker.output()[-2000:]}"

    wait_until(
        lambda: Replica.objects.filter(model_name="after-a", node__name="n1").exists(),
        timeout=max(1.0, 60 - (time.monotonic() - killed)),
        what=lambda: f"a replica of after-a placed within a minute of A's loss: {state()}",
    )
    wait_until(
        lambda: Replica.objects.filter(model_name="after-a", state="ready").exists(),
        timeout=max(1.0, 90 - (time.monotonic() - killed)),
        what=lambda: f"after-a's replica ready within 90 s of A's loss: {state()}",
    )
    # B's scheduler is the one sending now: the scan that found v2 and the reconcile passes.
    assert {"mirror-scan", "fleet-reconcile"} <= {entry for _, entry in sends(b.beat)}, b.beat.output()[-2000:]
