"""vLLM across several nodes (issue 37, contracts/ray.py): the node's half, a Ray cluster over the group.

A worker runs `ray start --address=HEAD:PORT --block` from its enrolled address and keeps it
running; the head runs `ray start --head --block`, waits until Ray counts every node of the group,
and only then starts `vllm serve` over it (agent/supervisor_loop.py). Each `ray start` stays in
the foreground for as long as Ray runs on its node, so its exit is Ray's failure on that node,
said in a sentence with its last lines; stopping its process group stops Ray's processes.

Ray's own ports are not fenced here the way llama.cpp's rpc-server is (agent/rpc_group.py): Ray
has no authentication either, and its nodes must reach each other on ports it picks itself, so a
vLLM group belongs on a network of its own GPU nodes (docs/engines.md).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from contracts import ray as commands

from . import engine_state, engines

log = logging.getLogger("agent.supervisor")

RAY_SETTING = "LLMGW_RAY"
# How long the head waits for every worker to join its Ray, and a worker for the head's Ray to take
# it: the control plane sends the workers' orders first, but an agent may be slow to take its own.
JOIN_S = 300.0
# How long `ray status` may take (it starts a Python interpreter and asks the head).
STATUS_TIMEOUT_S = 30.0
# How long a worker's `ray start` that exits before joining is given before it is tried again.
RETRY_S = 2.0
# How often the head asks its Ray whether every worker has joined (`ray status` is a process).
POLL_S = 1.0


def ray(which: Callable[[str], str | None] = shutil.which) -> str | None:
    """Ray's command line on this node: LLMGW_RAY, or `ray` on PATH (installed with vLLM)."""
    if configured := os.environ.get(RAY_SETTING, "").strip():
        return configured if os.access(configured, os.X_OK) else None
    return which("ray")


MISSING = "ray is not installed on this node (no ray on PATH, LLMGW_RAY unset): vLLM across nodes needs it"


def started(log: Path, since: int) -> bool:
    """`ray start` said its node is up (a head) or joined (a worker), in the log written past `since`."""
    try:
        with open(log, "rb") as f:
            f.seek(since)
            return commands.STARTED.encode() in f.read()
    except OSError:
        return False


def log_size(log: Path) -> int:
    try:
        return log.stat().st_size
    except OSError:
        return 0


def spawn(argv: tuple[str, ...], log: Path, where: Path, user: tuple[int, int] | None) -> subprocess.Popen:
    """`ray start` in its own session, as the engines' user, with an engine's environment (no secret)."""
    where.mkdir(parents=True, exist_ok=True)
    return engines.spawn(list(argv), log, engines.engine_env("vllm", "", where), cwd=where, user=user)


def joined(head_address: str, port: int) -> int:
    """How many nodes the head's Ray counts now; 0 when `ray status` fails or is not there."""
    binary = ray()
    if binary is None:
        return 0
    try:
        done = subprocess.run(
            list(commands.status_argv(head_address, port, binary)),
            capture_output=True,
            text=True,
            timeout=STATUS_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
            env=engines.engine_env("vllm"),
        )
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return commands.joined_nodes(done.stdout) if done.returncode == 0 else 0


# --- a worker (kept by agent.rpc_group.Workers beside rpc-server's, in the same wants file) ---------------


def worker_dir(cache: Path, replica_id: int) -> Path:
    return engine_state.state_dir(cache) / "ray" / f"replica-{int(replica_id)}"


def start_worker(
    cache: Path, replica_id: int, entry: dict, listen: str, user: tuple[int, int] | None, now: float
) -> subprocess.Popen:
    """Start this worker's `ray start --address`, recorded in its entry; EngineError says why not."""
    binary = ray()
    if binary is None:
        raise engines.EngineError(f"this node cannot be a vLLM worker: {MISSING}")
    where = worker_dir(cache, replica_id)
    log = where / "ray.log"
    since = log_size(log)
    argv = commands.worker_argv(entry["head_address"], listen, int(entry["ray_port"]), binary)
    process = spawn(argv, log, where, user)
    entry.update(ray_pid=process.pid, log_from=since, ready=False, started=entry.get("started") or now)
    return process


def check_worker(cache: Path, replica_id: int, entry: dict, alive: bool, now: float) -> tuple[str, str] | None:
    """A worker's `ray start` looked at: a report when its state changed, None when it did not.

    Before it joined, an exit is tried again (the head's Ray may not be up yet) until JOIN_S
    has passed; after, an exit is this worker's Ray gone, and fails the group.
    """
    log = worker_dir(cache, replica_id) / "ray.log"
    if alive:
        if not entry.get("ready") and started(log, entry.get("log_from", 0)):
            entry["ready"] = True
            return "ready", ""
        return None
    entry.pop("ray_pid", None)
    head = f"{entry['head_address']}:{entry['ray_port']}"
    if entry.get("ready"):
        entry.update(ready=False, failed=True)
        return "failed", f"this worker's ray exited; its last lines:\n{engines.last_lines(log)}"
    if now - entry.get("started", now) > JOIN_S:
        entry["failed"] = True
        return "failed", (
            f"this worker's ray could not join the head's Ray at {head} within {JOIN_S:g} s; "
            f"its last lines:\n{engines.last_lines(log)}"
        )
    entry["retry_at"] = now + RETRY_S
    return None


def stop(pid: int | None, child: subprocess.Popen | None = None) -> None:
    """Ray's processes on this node for one group, by the process group of its `ray start`."""
    if not pid:
        return
    engines.stop_group(pid, grace=5)
    if child is not None:
        child.wait(timeout=5)


# --- the head ----------------------------------------------------------------------------


class Head:
    """The head's Ray, started before `vllm serve` and stopped with it; its state is the replica's entry["ray"]."""

    def __init__(self, cache: Path, listen: str, user: tuple[int, int] | None):
        self.cache = Path(cache)
        self.listen = listen  # the enrolled address: the workers join here
        self.user = user
        self.children: dict[int, subprocess.Popen] = {}

    def log(self, replica_id: int) -> Path:
        return worker_dir(self.cache, replica_id) / "ray-head.log"

    def start(self, replica_id: int, port: int, now: float) -> dict:
        binary = ray()
        if binary is None:
            raise engines.EngineError(MISSING)
        log = self.log(replica_id)
        since = log_size(log)
        process = spawn(commands.head_argv(self.listen, port, binary), log, log.parent, self.user)
        self.children[process.pid] = process
        return {"pid": process.pid, "port": port, "address": self.listen, "since": now, "log_from": since}

    def alive(self, ray: dict) -> bool:
        child = self.children.get(ray["pid"])
        if child is not None:
            return child.poll() is None
        return engines.group_alive(ray["pid"])

    def waiting(self, replica_id: int, ray: dict, nodes: int, workers: list[str], now: float) -> str | None:
        """Why `vllm serve` cannot start yet: "" while Ray comes up and the workers join, a sentence
        once it never will (the head's Ray exited, or the workers did not join in time); None: go."""
        log = self.log(replica_id)
        if not self.alive(ray):
            return f"the head's ray exited; its last lines:\n{engines.last_lines(log)}"
        if started(log, ray.get("log_from", 0)) and joined(ray["address"], ray["port"]) >= nodes:
            return None
        if now - ray["since"] > JOIN_S:
            count = joined(ray["address"], ray["port"])
            return (
                f"{count} of the group's {nodes} nodes joined the head's Ray at {ray['address']}:{ray['port']} "
                f"within {JOIN_S:g} s (its workers: {', '.join(workers)})"
            )
        return ""

    def stop(self, ray: dict | None) -> None:
        if ray:
            stop(ray["pid"], self.children.pop(ray["pid"], None))

    def before_serve(self, entry: dict, now: float, backoff_max: float) -> bool | tuple[int, str, str, str] | None:
        """A vLLM group's head before `vllm serve` (a supervisor's entry): its Ray head started, then every
        worker joined.

        True once the group is whole; None while it comes together (looked at again in POLL_S);
        a report when the head's Ray started, or failed, or the workers did not join in time.
        """
        replica_id, group = entry["replica"], entry["group"]
        workers = [str(w.get("node", "?")) for w in group.get("workers", [])]
        ray = entry.get("ray")
        if ray is None:
            try:
                entry["ray"] = self.start(replica_id, int(group["ray_port"]), now)
            except (engines.EngineError, OSError) as e:
                reason = f"the head of this vLLM replica across nodes could not start its Ray: {e}"
                entry.update(next_start=now + backoff_max, reason=reason)
                return (replica_id, "failed", "", reason)
            log.info("replica %s: started the head's ray as pid %s, for %s", replica_id, entry["ray"]["pid"], workers)
            entry["next_start"] = now + POLL_S
            return (replica_id, "starting", "", "")
        why = self.waiting(replica_id, ray, 1 + len(workers), workers, now)
        if why is None:
            return True
        if not why:
            entry["next_start"] = now + POLL_S
            return None
        self.stop(entry.pop("ray"))
        restarts = entry.get("restarts", 0) + 1
        delay = min(backoff_max, 2.0 ** (restarts - 1))
        reason = f"{why}; starting it again in {delay:.0f} s"
        entry.update(ready=False, restarts=restarts, next_start=now + delay, reason=reason)
        log.warning("replica %s: %s", replica_id, reason)
        return (replica_id, "failed", "", reason)
