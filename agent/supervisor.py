"""The node's engine supervisor: keeps wanted engines running, outliving any one task.

A Celery task lasts as long as a fetch; an engine has to run for weeks. So the
task only records what it wants in a state file under the agent's cache
(`agent.engine_state`), and this supervisor — one process per node, started beside the agent's worker —
starts engines, health-checks them, restarts them after a crash with backoff,
stops them on request, and reports each change to the control plane.

The state file is also what survives the agent: engines run in their own
sessions, and a supervisor that starts finds in the file what its predecessor
started, adopts what is still running and wanted, and stops what is not.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import django
import psutil
from django.conf import settings

from contracts import credentials, signing

from . import cache_evict, engine_state, engine_stats, engines, fence, rpc_group, runtime, unix_address
from .replica_reports import Report, celery_report

__all__ = ["Report", "Supervisor", "celery_report", "start"]

log = logging.getLogger(__name__)

BACKOFF_MAX_S = 60.0
# Ready this long, and a crash afterwards is a new trouble, not the same one again.
STABLE_S = 60.0
STARTUP_TIMEOUT_S = 600.0
# Reports are repeated this often: a lost one heals, and a replica that was moved
# while this node was away is found out and stopped by the control plane.
REREPORT_S = 60.0
# A ready engine is asked whether it still answers this often; after this many
# unanswered checks in a row it is taken for hung (alive but serving nobody), killed
# and started again. Generous, because an engine busy generating answers slowly.
LIVENESS_INTERVAL_S = 10.0
# How often the loop looks while an engine starts: its readiness is seen within this of its first answer.
# A look at a starting engine is one connection to its loopback port (refused until it listens).
STARTING_INTERVAL_S = 0.05
LIVENESS_TIMEOUT_S = 5.0
LIVENESS_FAILURES = 3
# An unanswered check does not count while the engine is busy: using at least this share
# of a core since the last check. llama.cpp answers no check while it reads a long prompt
# (a megabyte took 30-38 s), and killing it then cut every other request; a hung engine
# (deadlocked, stopped) uses none. Busy and silent for this long, it is taken for stuck in
# a loop: the gateway has given up on its requests by then (LLMGW_GATEWAY_UPSTREAM_TIMEOUT_S).
BUSY_CPU_SHARE = 0.05
LIVENESS_BUSY_GRACE_S = 600.0


class Supervisor:
    def __init__(
        self,
        cache: Path,
        report: Report,
        *,
        host: str = "127.0.0.1",
        advertise: str = "",
        allow_remote_code: bool = False,
        startup_timeout: float = STARTUP_TIMEOUT_S,
        backoff_max: float = BACKOFF_MAX_S,
        liveness_interval: float = LIVENESS_INTERVAL_S,
        liveness_timeout: float = LIVENESS_TIMEOUT_S,
        liveness_failures: int = LIVENESS_FAILURES,
        liveness_busy_grace: float = LIVENESS_BUSY_GRACE_S,
        token: str | None = None,
        engine_user: str = "",
        rpc_listen: str = "",
    ):
        self.cache = Path(cache)
        # (uid, gid) engines run as (LLMGW_ENGINE_USER, agent.fence); None: the agent's own.
        self.engine_user = fence.engine_user(engine_user)
        self.engine_user_name = engine_user
        # The node's enrolment token keys each engine's secret (contracts.credentials);
        # only a fingerprint of the key of those secrets is written down, to find engines
        # started under another token (or under the token hash itself, before replica keys).
        token = runtime.token() if token is None else token
        self.key = signing.token_hash(token) if token else ""
        self.key_id = hashlib.sha256(credentials.replica_key(self.key).encode()).hexdigest()[:16] if self.key else ""
        self.report = report
        # The same report, repeated so a lost one is made good: batched where the reporter can.
        self.report_again = getattr(report, "again", report)
        self.host = host
        # 0.0.0.0 is an address to bind, not one to connect to: the gateway reaches
        # an engine listening everywhere by this host's name.
        self.advertise = advertise or (socket.gethostname() if host in ("0.0.0.0", "::", "") else host)
        # Where this node itself asks an engine whether it answers.
        self.check_host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        self.allow_remote_code = allow_remote_code
        self.startup_timeout = startup_timeout
        self.backoff_max = backoff_max
        self.liveness_interval = liveness_interval
        self.liveness_timeout = liveness_timeout
        self.liveness_failures = liveness_failures
        self.liveness_busy_grace = liveness_busy_grace
        # Engines this process started, so their exit is reaped and its code known.
        self.children: dict[int, subprocess.Popen] = {}
        self.last_report: dict[int, float] = {}
        # Set by each step: an engine is starting, so the next look comes in STARTING_INTERVAL_S.
        self.starting = False
        # This node's shares of replicas across several nodes (agent.rpc_group): stunnel listens
        # on the address the node was enrolled with, rpc-server on loopback behind it.
        self.rpc_workers = rpc_group.Workers(
            self.cache, report, self.key, listen=rpc_listen or self.host, user=self.engine_user
        )

    def log_path(self, replica_id: int) -> Path:
        return engine_state.state_dir(self.cache) / f"replica-{replica_id}.log"

    def scratch(self, replica_id: int) -> Path:
        """The engine's own writable directory: its HOME, TMPDIR and working directory."""
        return engine_state.state_dir(self.cache) / "scratch" / f"replica-{replica_id}"

    def _prepare_scratch(self, replica_id: int) -> Path:
        """Made by the agent, writable by the engine's group alone (the engine's user's primary group).

        Its group is changed rather than its owner: the agent's user may give a directory to a
        group it is in, and needs no CAP_CHOWN for it.
        """
        scratch = self.scratch(replica_id)
        scratch.mkdir(parents=True, exist_ok=True)
        if self.engine_user is None:
            scratch.chmod(0o700)
        else:
            os.chown(scratch, -1, self.engine_user[1])
            scratch.chmod(0o770)
        return scratch

    def endpoint(self, port: int) -> str:
        # The form the control plane accepts, and the only one: http://ADDRESS:PORT/v1, ADDRESS as enrolled.
        host = f"[{self.advertise}]" if ":" in self.advertise else self.advertise
        return f"http://{host}:{port}/v1"

    def secret(self, entry: dict) -> str:
        """What the engine of this entry answers to, and the gateway presents; empty without a token."""
        return credentials.replica_secret(self.key, entry["replica"], entry.get("nonce", ""))

    def adopt(self) -> None:
        """On start: keep what a previous supervisor left running, if it is still ours."""
        with engine_state.locked_state(self.cache) as state:
            for entry in state["replicas"].values():
                pid = entry.get("pid")
                if pid and not engine_state.is_ours(entry):
                    log.info("replica %s: its engine (pid %s) is gone", entry["replica"], pid)
                    entry.update(pid=None, ready=False)
                elif pid and entry.get("keyed", "") != self.key_id:
                    # Re-enrolled: the gateway now presents secrets made with the new token.
                    log.info(
                        "replica %s: its engine (pid %s) was started under another enrolment token, or none; "
                        "starting it again with its secret",
                        entry["replica"],
                        pid,
                    )
                    engines.stop_group(pid, grace=5)
                    entry.update(pid=None, ready=False, next_start=0.0)
                elif pid:
                    log.info("replica %s: adopting the engine still running as pid %s", entry["replica"], pid)
                    # Checked again before it is called ready: it may have hung meanwhile.
                    entry.update(ready=False, started=time.time())

    def _alive(self, entry: dict) -> tuple[bool, int | None]:
        """Whether the engine runs, and its exit code when we saw it end."""
        pid = entry["pid"]
        child = self.children.get(pid)
        if child is not None:
            code = child.poll()
            if code is None:
                return True, None
            del self.children[pid]
            return False, code
        return engines.group_alive(pid), None

    def step(self) -> None:
        """One look at every replica; the loop calls this about twice a second."""
        now = time.time()
        reports: list[tuple[int, str, str, str]] = []
        repeats: list[tuple[int, str, str, str]] = []
        to_stop: list[dict] = []
        to_check: list[tuple[int, int, int]] = []
        with engine_state.locked_state(self.cache) as state:
            for entry in list(state["replicas"].values()):
                replica_id = entry["replica"]
                if not entry["wanted"]:
                    to_stop.append(entry)
                    continue
                if entry["pid"] is None:
                    if now >= entry.get("next_start", 0):
                        reports.append(self._start(entry, now))
                    continue
                alive, code = self._alive(entry)
                if not alive:
                    reports.append(self._crashed(entry, now, code))
                elif not entry["ready"]:
                    if engines.answers(
                        entry["port"],
                        host=self.check_host,
                        timeout=0.5,
                        secret=self.secret(entry),
                        engine=entry["engine"],
                    ):
                        # What the liveness check measured was of the engine before this one.
                        entry.update(ready=True, ready_since=now, cpu=None, busy_since=None)
                        reports.append((replica_id, "ready", self.endpoint(entry["port"]), ""))
                    elif now - entry.get("started", now) > self.startup_timeout:
                        engines.stop_group(entry["pid"], grace=5)
                        self.children.pop(entry["pid"], None)
                        reports.append(
                            self._crashed(entry, now, None, f"did not answer within {self.startup_timeout:.0f} s")
                        )
                elif entry.get("group") and (
                    lost := rpc_group.Tunnels.dropped(entry["group"], entry.get("tunnels", {}))
                ):
                    # A worker gone while the engine sat idle: llama-server would find out at the next request.
                    engines.stop_group(entry["pid"], grace=5)
                    self.children.pop(entry["pid"], None)
                    reports.append(self._crashed(entry, now, None, lost))
                else:
                    if now - entry.get("ready_since", now) > STABLE_S:
                        entry["restarts"] = 0
                    if now - entry.get("checked", entry.get("ready_since", now)) >= self.liveness_interval:
                        to_check.append((replica_id, entry["pid"], entry["port"], self.secret(entry), entry["engine"]))
                if now - self.last_report.get(replica_id, 0) > REREPORT_S and not any(
                    r[0] == replica_id for r in reports
                ):
                    repeats.append(self._current(entry))
            # An engine started and not yet answering, or one due to start: the loop looks again soon.
            self.starting = any(
                e["wanted"] and not e["ready"] and (e["pid"] is not None or e.get("next_start", 0) <= now)
                for e in state["replicas"].values()
            )
        for entry in to_stop:
            if (stopped := self._stop(entry)) is not None:
                reports.append(stopped)
        reports += self._check_liveness(to_check, now)
        try:
            self.rpc_workers.step()
        except Exception:
            log.exception("the RPC workers' step failed")
        changed = {r[0] for r in reports}
        for send, batch in ((self.report, reports), (self.report_again, [r for r in repeats if r[0] not in changed])):
            for replica_id, *rest in batch:
                self.last_report[replica_id] = now
                try:
                    send(replica_id, *rest)
                except Exception:
                    # The broker may be away for a moment; the report is repeated later.
                    log.exception("replica %s: the report could not be sent", replica_id)

    def _check_liveness(
        self, to_check: list[tuple[int, int, int, str, str]], now: float
    ) -> list[tuple[int, str, str, str]]:
        """Ask ready engines whether they answer; outside the state lock, since a hung one takes the whole timeout."""
        answered = {
            replica_id: engines.answers(
                port, host=self.check_host, timeout=self.liveness_timeout, secret=secret, engine=engine
            )
            for replica_id, _, port, secret, engine in to_check
        }
        cpu = {replica_id: cpu_seconds(pid) for replica_id, pid, *_ in to_check}
        reports = []
        with engine_state.locked_state(self.cache) as state:
            for replica_id, pid, port, *_ in to_check:
                entry = state["replicas"].get(str(replica_id))
                if entry is None or not entry.get("ready") or entry.get("pid") != pid or entry.get("port") != port:
                    continue  # stopped, restarted or replaced meanwhile
                last_cpu, last_checked = entry.get("cpu"), entry.get("checked")
                entry["checked"], entry["cpu"] = now, cpu[replica_id]
                if answered[replica_id]:
                    entry.update(unanswered=0, busy_since=None)
                    continue
                busy = None not in (last_cpu, last_checked, cpu[replica_id]) and (
                    cpu[replica_id] - last_cpu >= BUSY_CPU_SHARE * max(now - last_checked, 0.001)
                )
                if busy:
                    entry["unanswered"] = 0
                    entry["busy_since"] = entry.get("busy_since") or now
                    if now - entry["busy_since"] < self.liveness_busy_grace:
                        log.info(
                            "replica %s: the engine is busy and did not answer its check; left to work", replica_id
                        )
                        continue
                    why = f"stopped answering (busy and silent for {now - entry['busy_since']:.0f} s)"
                else:
                    entry["busy_since"] = None
                    entry["unanswered"] = entry.get("unanswered", 0) + 1
                    if entry["unanswered"] < self.liveness_failures:
                        continue
                    why = f"stopped answering ({self.liveness_failures} health checks in a row went unanswered)"
                log.warning("replica %s: the engine (pid %s) stopped answering; killing it", replica_id, pid)
                engines.stop_group(pid, grace=5)
                child = self.children.pop(pid, None)
                if child is not None:
                    child.wait(timeout=5)
                entry["unanswered"] = 0
                reports.append(self._crashed(entry, now, None, why))
        return reports

    def _current(self, entry: dict) -> tuple[int, str, str, str]:
        if entry["ready"]:
            return (entry["replica"], "ready", self.endpoint(entry["port"]), "")
        return (entry["replica"], "starting" if entry["pid"] else "failed", "", entry.get("reason", ""))

    def _start(self, entry: dict, now: float) -> tuple[int, str, str, str]:
        replica_id = entry["replica"]
        port = engines.free_port(self.host)
        try:
            argv = engines.command(
                entry["engine"],
                Path(entry["weights"]),
                port,
                entry["args"],
                model=entry.get("model", ""),
                host=self.host,
                allow_remote_code=self.allow_remote_code,
            )
        except engines.EngineError as e:
            # Permanent: starting again would fail the same way until the catalog changes.
            entry.update(next_start=float("inf"), reason=str(e))
            return (replica_id, "failed", "", str(e))
        if entry.get("group"):
            try:
                argv += self._open_tunnels(entry)
            except (engines.EngineError, OSError, ValueError) as e:
                reason = f"the head of this replica across nodes could not start its tunnels: {e}"
                entry.update(next_start=now + self.backoff_max, reason=reason)
                return (replica_id, "failed", "", reason)
        if not self.key:
            log.warning(
                "replica %s: this node has no enrolment token, so its engine is started without a secret "
                "and answers anyone who reaches its port",
                replica_id,
            )
        # The secret goes in the engine's environment: argv is on every user's `ps`, and in the state file.
        try:
            scratch = self._prepare_scratch(replica_id)
            env = engines.engine_env(entry["engine"], self.secret(entry), scratch)
            process = engines.spawn(argv, self.log_path(replica_id), env, cwd=scratch, user=self.engine_user)
        except PermissionError as error:
            # The agent lacks what LLMGW_ENGINE_USER needs, or the engine's user cannot run the
            # engine or enter its scratch: the same again until an operator acts.
            who = f"as {self.engine_user_name} (LLMGW_ENGINE_USER)" if self.engine_user else "as the agent's user"
            reason = f"the engine could not be started {who}: {error} (docs/agent.md, Engines fenced)"
            entry.update(next_start=float("inf"), reason=reason)
            return (replica_id, "failed", "", reason)
        self.children[process.pid] = process
        entry.update(
            pid=process.pid,
            pid_started=engines.start_time(process.pid),
            port=port,
            argv=argv,
            ready=False,
            started=now,
            keyed=self.key_id,
        )
        log.info(
            "replica %s: started %s as pid %s on port %s%s",
            replica_id,
            entry["engine"],
            process.pid,
            port,
            _threads_said(argv),
        )
        return (replica_id, "starting", "", "")

    def _open_tunnels(self, entry: dict) -> list[str]:
        """The head's tunnels to its workers, and llama-server's arguments that use them."""
        self._close_tunnels(entry)
        group = entry["group"]
        ports, pids = rpc_group.Tunnels(self.cache, self.key).start(entry["replica"], entry.get("nonce", ""), group)
        entry["tunnels"] = {"ports": ports, "pids": pids}
        weights = engines.weights_argument("llamacpp", Path(entry["weights"]))
        return rpc_group.head_args(group, ports, rpc_group.layer_count(weights))

    def _close_tunnels(self, entry: dict) -> str:
        """Stop the head's tunnels; first, which worker was lost, when one was (a sentence, or empty)."""
        tunnels = entry.pop("tunnels", None)
        if not tunnels or not entry.get("group"):
            return ""
        lost = rpc_group.Tunnels.lost(entry["group"], tunnels["ports"], tunnels["pids"])
        rpc_group.Tunnels.stop(tunnels["pids"])
        return lost

    def _crashed(self, entry: dict, now: float, code: int | None, why: str = "") -> tuple[int, str, str, str]:
        restarts = entry.get("restarts", 0) + 1
        delay = min(self.backoff_max, 2.0 ** (restarts - 1))
        why = why or (f"exited with code {code}" if code is not None else "exited")
        if lost := self._close_tunnels(entry):
            why = f"{why}: it {lost}" if not why.startswith("lost") else why
        reason = f"the engine {why}; starting it again in {delay:.0f} s. Its last lines:\n" + engines.last_lines(
            self.log_path(entry["replica"])
        )
        entry.update(pid=None, ready=False, restarts=restarts, next_start=now + delay, reason=reason)
        log.warning("replica %s: %s", entry["replica"], reason)
        return (entry["replica"], "failed", "", reason)

    def _stop(self, entry: dict) -> tuple[int, str, str, str] | None:
        replica_id = entry["replica"]
        if entry.get("pid"):
            engines.stop_group(entry["pid"])
            child = self.children.pop(entry["pid"], None)
            if child is not None:
                child.wait(timeout=5)
        if tunnels := entry.get("tunnels"):
            rpc_group.Tunnels.stop(tunnels["pids"])
        with engine_state.locked_state(self.cache) as state:
            current = state["replicas"].get(str(replica_id))
            if current and current.get("wanted"):
                # Wanted again while it was being stopped: the next step starts it.
                return None
            replace = current.get("replace") if current else None
            if replace:
                # Stopped to be started anew with a different spec, not to go away.
                current.update(replace, wanted=True, pid=None, ready=False, restarts=0, next_start=0.0)
                current.pop("replace")
                return (replica_id, "starting", "", "")
            state["replicas"].pop(str(replica_id), None)
        # What the engine left in its scratch; a subdirectory it made unreadable to the agent stays.
        shutil.rmtree(self.scratch(replica_id), ignore_errors=True)
        log.info("replica %s: stopped", replica_id)
        return (replica_id, "stopped", "", "")

    def run(self, stop: threading.Event, interval: float = 0.5, starting_interval: float = STARTING_INTERVAL_S) -> None:
        """Look at the engines twice a second; at once when a task wants a start or a stop (engine_state.poke),
        and every STARTING_INTERVAL_S while one starts, so its readiness is seen as it comes (issue 39)."""
        self.adopt()
        with Waker(self.cache) as waker:
            while not stop.is_set():
                try:
                    self.step()
                    busy = self.starting
                except Exception:
                    log.exception("supervisor step failed")
                    busy = False
                waker.wait(starting_interval if busy else interval)


class Waker:
    """The supervisor's end of engine_state.poke: a datagram socket in the state directory, waited on with a timeout."""

    def __init__(self, cache: Path) -> None:
        self.path = engine_state.waker_path(cache)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # a socket the last supervisor left: no one reads it
        with unix_address.reachable(self.path) as address:
            self.sock.bind(address)
        self.sock.setblocking(False)

    def __enter__(self) -> Waker:
        return self

    def __exit__(self, *exc) -> None:
        self.sock.close()
        with contextlib.suppress(OSError):
            self.path.unlink()

    def wait(self, timeout: float) -> None:
        """Until a poke, or `timeout` seconds; every poke waiting is taken, so a burst is one look."""
        ready, _, _ = select.select([self.sock], [], [], timeout)
        while ready:
            try:
                self.sock.recv(16)
            except BlockingIOError:
                break


def _threads_said(argv: list[str]) -> str:
    """ ", 2 threads, 4 slots": what the engine was given, in the supervisor's log beside the start."""
    said = []
    for flag, what in (("--threads", "threads"), ("-t", "threads"), ("--parallel", "slots"), ("-np", "slots")):
        if flag in argv[:-1]:
            said.append(f"{argv[argv.index(flag) + 1]} {what}")
    return (", " + ", ".join(said)) if said else ""


def cpu_seconds(pid: int) -> float | None:
    """CPU time the engine and its children have used so far; None when it cannot be read."""
    try:
        process = psutil.Process(pid)
        members = [process, *process.children(recursive=True)]
    except psutil.Error:
        return None
    used = 0.0
    for member in members:
        try:
            used += sum(member.cpu_times()[:2])  # user and system
        except psutil.Error:
            pass  # a child that ended meanwhile
    return used


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
    engine_state.state_dir(options.cache).mkdir(parents=True, exist_ok=True)
    # One supervisor per cache: a restarted agent's new one waits for the old one to notice and go.
    single = open(engine_state.state_dir(options.cache) / "supervisor.lock", "a")
    deadline = time.monotonic() + 30
    while True:
        try:
            fcntl.flock(single, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() > deadline:
                print(f"another supervisor still runs the engines under {options.cache}", file=sys.stderr)
                return 1
            time.sleep(0.5)

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    if options.parent:

        def watch_parent() -> None:
            while not stop.is_set():
                if os.getppid() != options.parent:
                    stop.set()
                stop.wait(1)

        threading.Thread(target=watch_parent, daemon=True).start()
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
    # The engines' own count of their load (slots busy, requests deferred), for the control plane.
    reader = engine_stats.StatsReader(options.cache, runtime.node_name(), supervisor.key, host=supervisor.check_host)
    threading.Thread(target=reader.run, args=(stop,), name="engine-stats", daemon=True).start()
    # The node's disk: unused weights evicted above the cache's bounds, engine logs rotated.
    bounds = cache_evict.Bounds(
        settings.NODE_CACHE_MAX_GB * cache_evict.GiB, settings.NODE_CACHE_FREE_GB * cache_evict.GiB
    )
    threading.Thread(target=cache_evict.keep, args=(options.cache, bounds, stop), name="disk", daemon=True).start()
    supervisor.run(stop)
    # Engines are left running on purpose: the next supervisor adopts them.
    return 0


if __name__ == "__main__":
    sys.exit(main())
