"""The supervisor's loop over this node's replicas: start each engine wanted, see it ready, check it
still answers, restart it after a crash with backoff, stop it when it is no longer wanted.

`Supervisor.run` is the loop; agent/supervisor.py is the process that runs it. What a
replica is meant to be doing is in the state file (agent/engine_state.py); each change is
reported to the control plane (agent/replica_reports.py).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

from contracts import credentials, signing
from contracts import ray as ray_commands

from . import engine_state, engines, fence, liveness, ray_group, rpc_group, runtime
from .liveness import LIVENESS_BUSY_GRACE_S, LIVENESS_FAILURES, LIVENESS_INTERVAL_S, LIVENESS_TIMEOUT_S
from .replica_reports import Report

# The supervisor's log, whichever of its modules writes the line.
log = logging.getLogger("agent.supervisor")

BACKOFF_MAX_S = 60.0
# Ready this long, and a crash afterwards is a new trouble, not the same one again.
STABLE_S = 60.0
STARTUP_TIMEOUT_S = 600.0
# Reports are repeated this often: a lost one heals, and a replica that was moved
# while this node was away is found out and stopped by the control plane.
REREPORT_S = 60.0
# How often the loop looks while an engine starts: its readiness is seen within this of its first answer.
# A look at a starting engine is one connection to its loopback port (refused until it listens).
STARTING_INTERVAL_S = 0.05


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
        # A vLLM group's head runs a Ray head at the enrolled address, where its workers join it.
        self.ray_head = ray_group.Head(self.cache, rpc_listen or self.advertise, self.engine_user)

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
        to_check: list[tuple[int, int, int, str, str]] = []
        with engine_state.locked_state(self.cache) as state:
            for entry in list(state["replicas"].values()):
                replica_id = entry["replica"]
                if not entry["wanted"]:
                    to_stop.append(entry)
                    continue
                if entry["pid"] is None:
                    if now >= entry.get("next_start", 0) and (started := self._start(entry, now)) is not None:
                        reports.append(started)
                    continue
                if (report := self._look(entry, now, to_check)) is not None:
                    reports.append(report)
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
        self._send(reports, repeats, now)

    def _look(self, entry: dict, now: float, to_check: list) -> tuple[int, str, str, str] | None:
        """One running engine under the state lock: its report when it changed; a ready one due a check joins
        `to_check`, asked outside the lock."""
        alive, code = self._alive(entry)
        if not alive:
            return self._crashed(entry, now, code)
        if not entry["ready"]:
            if engines.answers(
                entry["port"], host=self.check_host, timeout=0.5, secret=self.secret(entry), engine=entry["engine"]
            ):
                # What the liveness check measured was of the engine before this one.
                entry.update(ready=True, ready_since=now, cpu=None, busy_since=None)
                return (entry["replica"], "ready", self.endpoint(entry["port"]), "")
            if now - entry.get("started", now) > self.startup_timeout:
                engines.stop_group(entry["pid"], grace=5)
                self.children.pop(entry["pid"], None)
                return self._crashed(entry, now, None, f"did not answer within {self.startup_timeout:.0f} s")
            return None
        if entry.get("ray") and not self.ray_head.alive(entry["ray"]):
            # vLLM's workers run under the head's Ray: without it the engine answers nothing more.
            engines.stop_group(entry["pid"], grace=5)
            self.children.pop(entry["pid"], None)
            self.ray_head.stop(entry.pop("ray"))
            return self._crashed(entry, now, None, "lost the head's ray, which exited")
        if (
            entry.get("group")
            and entry["engine"] == "llamacpp"
            and (lost := rpc_group.Tunnels.dropped(entry["group"], entry.get("tunnels", {})))
        ):
            # A worker gone while the engine sat idle: llama-server would find out at the next request.
            engines.stop_group(entry["pid"], grace=5)
            self.children.pop(entry["pid"], None)
            return self._crashed(entry, now, None, lost)
        if now - entry.get("ready_since", now) > STABLE_S:
            entry["restarts"] = 0
        if now - entry.get("checked", entry.get("ready_since", now)) >= self.liveness_interval:
            to_check.append((entry["replica"], entry["pid"], entry["port"], self.secret(entry), entry["engine"]))
        return None

    def _send(self, reports: list, repeats: list, now: float) -> None:
        """The changes, then the repeats of replicas that did not change; a report that fails is repeated later."""
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
        cpu = {replica_id: liveness.cpu_seconds(pid) for replica_id, pid, *_ in to_check}
        reports = []
        with engine_state.locked_state(self.cache) as state:
            for replica_id, pid, port, *_ in to_check:
                entry = state["replicas"].get(str(replica_id))
                if entry is None or not entry.get("ready") or entry.get("pid") != pid or entry.get("port") != port:
                    continue  # stopped, restarted or replaced meanwhile
                why = liveness.verdict(
                    entry,
                    answered[replica_id],
                    cpu[replica_id],
                    now,
                    failures=self.liveness_failures,
                    busy_grace=self.liveness_busy_grace,
                )
                if not why:
                    continue
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

    def _start(self, entry: dict, now: float) -> tuple[int, str, str, str] | None:
        """The engine started, and its report; None while a vLLM group's head waits for its Ray."""
        replica_id = entry["replica"]
        if (
            entry.get("group")
            and entry["engine"] == "vllm"
            and (waiting := self.ray_head.before_serve(entry, now, self.backoff_max)) is not True
        ):
            return waiting
        port = engines.free_port(self.host)
        try:
            argv = self._command(entry, port, now)
            process = self._spawn(entry, argv)
        except _NotStarted as not_started:
            entry.update(next_start=not_started.next_start, reason=str(not_started))
            return (replica_id, "failed", "", str(not_started))
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

    def _command(self, entry: dict, port: int, now: float) -> list[str]:
        """The engine's argv, with a head's tunnels to its workers; _NotStarted says why not."""
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
            raise _NotStarted(str(e), float("inf")) from None
        if entry.get("group") and entry["engine"] == "vllm":
            # Pipeline stages across the group's nodes, over the Ray its workers joined (contracts/ray.py).
            argv += ray_commands.group_serve_args(1 + len(entry["group"]["workers"]), entry["args"])
        elif entry.get("group"):
            try:
                argv += self._open_tunnels(entry)
            except (engines.EngineError, OSError, ValueError) as e:
                reason = f"the head of this replica across nodes could not start its tunnels: {e}"
                raise _NotStarted(reason, now + self.backoff_max) from None
        return argv

    def _spawn(self, entry: dict, argv: list[str]) -> subprocess.Popen:
        """The engine started in its scratch as its user, its secret in its environment; _NotStarted says why not."""
        replica_id = entry["replica"]
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
            if ray := entry.get("ray"):
                # vLLM's ray.init() joins the cluster RAY_ADDRESS names: this group's, not another on the host.
                env["RAY_ADDRESS"] = f"{ray['address']}:{ray['port']}"
            return engines.spawn(argv, self.log_path(replica_id), env, cwd=scratch, user=self.engine_user)
        except PermissionError as error:
            # The agent lacks what LLMGW_ENGINE_USER needs, or the engine's user cannot run the
            # engine or enter its scratch: the same again until an operator acts.
            who = f"as {self.engine_user_name} (LLMGW_ENGINE_USER)" if self.engine_user else "as the agent's user"
            reason = f"the engine could not be started {who}: {error} (docs/agent.md, Engines fenced)"
            raise _NotStarted(reason, float("inf")) from None

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
        # The group's Ray with its engine: a replaced group starts a Ray of its own.
        self.ray_head.stop(entry.get("ray"))
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
                current.pop("ray", None)
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
        with engine_state.Waker(self.cache) as waker:
            while not stop.is_set():
                try:
                    self.step()
                    busy = self.starting
                except Exception:
                    log.exception("supervisor step failed")
                    busy = False
                waker.wait(starting_interval if busy else interval)


class _NotStarted(Exception):
    """An engine that could not be started: str() is the reason, `next_start` when to try again."""

    def __init__(self, reason: str, next_start: float):
        super().__init__(reason)
        self.next_start = next_start


def _threads_said(argv: list[str]) -> str:
    """ ", 2 threads, 4 slots": what the engine was given, in the supervisor's log beside the start."""
    said = []
    for flag, what in (("--threads", "threads"), ("-t", "threads"), ("--parallel", "slots"), ("-np", "slots")):
        if flag in argv[:-1]:
            said.append(f"{argv[argv.index(flag) + 1]} {what}")
    return (", " + ", ".join(said)) if said else ""
