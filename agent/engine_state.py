"""What this node's engines are meant to be doing: the state file under the agent's cache.

A Celery task lasts as long as a fetch, an engine for weeks. So a task only writes
here what it wants (`want`, `unwant`), and the supervisor (`agent.supervisor`)
reads it, makes it so, and writes back what runs (pid, port, readiness). The file
also outlives the agent: engines run in their own sessions, and the next
supervisor finds in it what its predecessor started.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import socket
from collections.abc import Iterator
from pathlib import Path

from . import engines, unix_address


def state_dir(cache: Path) -> Path:
    return Path(cache) / "engines"


def waker_path(cache: Path) -> Path:
    """The supervisor's socket: a datagram here has it look at the state at once, not at its next turn."""
    return state_dir(cache) / "supervisor.sock"


def poke(cache: Path) -> None:
    """Tell the supervisor the state changed (a start or a stop wanted); nothing when none listens."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.setblocking(False)
        with unix_address.reachable(waker_path(cache)) as address:
            sock.sendto(b"!", address)


class Waker:
    """The supervisor's end of `poke`: a datagram socket in the state directory, waited on with a timeout."""

    def __init__(self, cache: Path) -> None:
        self.path = waker_path(cache)
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


@contextlib.contextmanager
def locked_state(cache: Path) -> Iterator[dict]:
    """The state file, read and written under a lock: tasks and the supervisor both edit it."""
    directory = state_dir(cache)
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "state.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        path = directory / "state.json"
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            state = {}
        state.setdefault("replicas", {})
        yield state
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        os.replace(tmp, path)


def read_state(cache: Path) -> dict:
    with locked_state(cache) as state:
        return json.loads(json.dumps(state))


def wanted_ids(cache: Path) -> list[int]:
    """The replicas this node runs or is starting, for the heartbeat.

    Read without the lock: the file is only ever replaced whole, and the heartbeat runs
    in the worker's event loop, which must not wait on a supervisor stopping an engine.
    """
    try:
        state = json.loads((state_dir(cache) / "state.json").read_text())
    except (OSError, ValueError):
        return []
    return sorted(int(k) for k, entry in state.get("replicas", {}).items() if entry.get("wanted"))


def _spec_of(entry: dict, keys) -> dict:
    # An entry written before the model name (or the nonce) was recorded has none: it was started without one.
    return {k: entry.get(k, "" if k in ("model", "nonce") else None) for k in keys}


def want(
    cache: Path,
    replica_id: int,
    engine: str,
    source: str,
    weights: Path,
    args: list[str],
    model: str = "",
    nonce: str = "",
    group: dict | None = None,
) -> bool:
    """Ask for this replica to run; False when it is already wanted exactly so.

    `nonce` is what the control plane sent to tell this replica from an earlier one of
    the same id; with the node's token it makes the engine's secret (contracts.credentials).
    The secret itself is never written here. `group` (contracts.groups.GroupOrder) makes this
    node the head of a replica across several nodes; its workers' keys are written sealed.
    """
    spec = {
        "engine": engine,
        "source": source,
        "weights": str(weights),
        "args": list(args),
        "model": model,
        "nonce": nonce,
        "group": group,
    }
    with locked_state(cache) as state:
        entry = state["replicas"].get(str(replica_id))
        if entry and entry.get("wanted") and _spec_of(entry, spec) == spec:
            return False
        if entry and entry.get("pid"):
            # Wanted differently: the running engine is stopped first and started anew.
            entry.update(wanted=False, replace=spec)
        else:
            state["replicas"][str(replica_id)] = _new_entry(replica_id, spec)
    poke(cache)
    return True


def _new_entry(replica_id: int, spec: dict) -> dict:
    return {
        "replica": replica_id,
        **spec,
        "wanted": True,
        "pid": None,
        "port": None,
        "argv": None,
        "ready": False,
        "restarts": 0,
        "next_start": 0.0,
    }


def wanted_as(
    cache: Path,
    replica_id: int,
    engine: str,
    source: str,
    args: list[str],
    model: str = "",
    nonce: str = "",
    group: dict | None = None,
) -> bool:
    """Whether this replica is already wanted exactly so; a waiting restart is brought forward.

    The control plane sends a start again when a replica has stayed failed; here
    that means "try now", not "fetch and start a second one".
    """
    with locked_state(cache) as state:
        entry = state["replicas"].get(str(replica_id))
        if not entry or not entry.get("wanted") or "replace" in entry:
            return False
        spec = {"engine": engine, "source": source, "args": list(args), "model": model, "nonce": nonce, "group": group}
        if _spec_of(entry, spec) != spec:
            return False
        if entry.get("pid") is None:
            entry["next_start"] = 0.0
    poke(cache)
    return True


def unwant(cache: Path, replica_id: int) -> bool:
    """Ask for this replica to stop; False when this node does not know it."""
    with locked_state(cache) as state:
        entry = state["replicas"].get(str(replica_id))
        if entry is None:
            return False
        entry["wanted"] = False
        entry.pop("replace", None)
    poke(cache)
    return True


def is_ours(entry: dict) -> bool:
    """Whether the engine an entry records is still running, and is the process it started as (not a reused pid)."""
    pid = entry.get("pid")
    return bool(pid) and engines.group_alive(pid) and engines.start_time(pid) == entry.get("pid_started")


def running_engines(cache: Path) -> list[tuple[int, int]]:
    """(replica id, pid) of every engine this host's agent started that still runs."""
    return [
        (int(replica_id), entry["pid"]) for replica_id, entry in read_state(cache)["replicas"].items() if is_ours(entry)
    ]
