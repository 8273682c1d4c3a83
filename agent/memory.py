"""What this node's engines really hold: resident memory per replica, GPU memory per process, and what is free.

Sent on every heartbeat (agent.tasks.send_heartbeat), so the control plane places and
makes room by what replicas use rather than what their profiles guessed (docs/placement.md).

- RSS and PSS of the engine's whole process tree (an engine may be a launcher and a
  worker): PSS splits the pages of mapped weights between the processes that share
  them, RSS counts them in each. Read with psutil (`memory_full_info`).
- GPU memory per process from `nvidia-smi --query-compute-apps`, on nodes that have it.
- The node's available memory (`MemAvailable`: free plus what the kernel can take back).
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
from pathlib import Path

import psutil

from . import engine_state

log = logging.getLogger(__name__)


def process_tree_memory(pid: int) -> dict[str, int] | None:
    """{rss, pss} in bytes of a process and all its descendants; None when it is gone.

    PSS is left out (not 0) where the kernel does not give it (no smaps_rollup, or not ours).
    """
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    rss = pss = 0
    pss_known = True
    for process in tree:
        try:
            info = process.memory_full_info()
        except psutil.AccessDenied:
            pss_known = False
            try:
                info = process.memory_info()
            except psutil.Error:
                continue
        except psutil.Error:
            continue
        rss += info.rss
        if getattr(info, "pss", None) is None:
            pss_known = False
        else:
            pss += info.pss
    out = {"rss": rss}
    if pss_known:
        out["pss"] = pss
    return out


def gpu_memory_by_pid(timeout: float = 10.0) -> dict[int, int]:
    """{pid: bytes of GPU memory} from nvidia-smi; empty where it is missing or fails."""
    binary = shutil.which("nvidia-smi")
    if binary is None:
        return {}
    try:
        done = subprocess.run(
            [binary, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except (OSError, subprocess.TimeoutExpired):
        return {}
    if done.returncode != 0:
        return {}
    used: dict[int, int] = {}
    for line in done.stdout.splitlines():
        pid, _, memory = (part.strip() for part in line.partition(","))
        if pid.isdigit() and memory.isdigit():
            # nvidia-smi says MiB; one process on several cards is listed once per card.
            used[int(pid)] = used.get(int(pid), 0) + int(memory) * (1 << 20)
    return used


def available_bytes() -> int:
    try:
        return int(psutil.virtual_memory().available)
    except (OSError, RuntimeError):
        return 0


def replica_memory(cache: Path) -> dict[str, dict[str, int]]:
    """{replica id: {rss, pss?, gpu?}} for every engine of this node that runs."""
    # Read without the lock, as wanted_ids is: the file is only ever replaced whole, and the
    # heartbeat must not wait on a supervisor stopping an engine.
    try:
        replicas = json.loads((engine_state.state_dir(cache) / "state.json").read_text()).get("replicas", {})
    except (OSError, ValueError, AttributeError):
        return {}
    gpu = None
    out: dict[str, dict[str, int]] = {}
    for replica_id, entry in replicas.items():
        if not engine_state.is_ours(entry):
            continue
        measured = process_tree_memory(entry["pid"])
        if measured is None:
            continue
        if gpu is None:
            gpu = gpu_memory_by_pid()
        if gpu:
            try:
                pids = [entry["pid"], *(p.pid for p in psutil.Process(entry["pid"]).children(recursive=True))]
            except psutil.Error:
                pids = [entry["pid"]]
            on_gpu = sum(gpu.get(pid, 0) for pid in pids)
            if on_gpu:
                measured["gpu"] = on_gpu
        out[str(replica_id)] = measured
    return out


def heartbeat_facts(cache: Path) -> dict:
    """What a heartbeat carries of memory: per replica, and the node's available memory."""
    try:
        replicas = replica_memory(cache)
    except Exception:  # a heartbeat goes out whatever measuring trips on
        log.exception("could not measure the engines' memory; this heartbeat goes without it")
        replicas = {}
    return {"replica_memory": replicas, "memory_available_bytes": available_bytes()}
