"""What a node tells the control plane about itself on every heartbeat.

Probed, never configured: an engine counts as installed when it can be run,
and a GPU when nvidia-smi lists it. What is configured (labels) is passed in.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

from . import __version__, engine_binary, rpc_group, runtime, selftest


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def engines() -> list[str]:
    found = []
    if engine_binary.llama_server():
        found.append("llamacpp")
    if shutil.which("vllm") or _importable("vllm"):
        found.append("vllm")
    return found


def gpus() -> list[dict]:
    """[{name, memory_mb}] from nvidia-smi; none where it is missing or fails (no driver, no GPU)."""
    binary = shutil.which("nvidia-smi")
    if binary is None:
        return []
    try:
        done = subprocess.run(
            [binary, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    if done.returncode != 0:
        return []
    found = []
    for line in done.stdout.splitlines():
        name, _, memory = line.rpartition(",")
        if name.strip() and memory.strip().isdigit():
            found.append({"name": name.strip(), "memory_mb": int(memory.strip())})
    return found


def memory_gb() -> int:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30))
    except (ValueError, OSError):
        return 0


def disk_free_bytes(path: Path) -> int:
    """Free bytes where the cache is, or on the nearest directory above it that exists yet."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return 0


def installed(cache: Path | None = None) -> dict:
    """The facts that change only when somebody installs something: probed at start and on each re-probe.

    An engine is listed only once it has passed its self-test (`selftest`); one that
    is installed and fails it is listed under `engines_unusable` with the reason.
    """
    found = engines()
    unusable = selftest.unusable(found, Path(cache or runtime.cache_dir()) / "selftest")
    usable = [e for e in found if e not in unusable]
    # A share of a replica across nodes (issue 37): probed by running rpc-server, stunnel and llama-server.
    rpc = "llamacpp" in usable and rpc_group.can_be_worker()
    head = "llamacpp" in usable and rpc_group.can_be_head()
    return {"engines": usable, "engines_unusable": unusable, "gpus": gpus(), "rpc": rpc, "rpc_head": head}


def collect(node: str, labels: dict, cache: Path, static: dict | None = None) -> dict:
    static = static if static is not None else installed(cache)
    return {
        "node": node,
        "engines": static["engines"],
        "engines_unusable": static.get("engines_unusable", {}),
        "gpus": static["gpus"],
        "rpc": bool(static.get("rpc", False)),
        "rpc_head": bool(static.get("rpc_head", False)),
        "memory_gb": memory_gb(),
        "disk_free_bytes": disk_free_bytes(cache),
        "labels": dict(labels),
        "agent_version": __version__,
    }


def parse_labels(raw: str) -> dict[str, str]:
    """`k=v,k2=v2` into a dict; a malformed pair is a sentence, not a guess."""
    labels: dict[str, str] = {}
    for pair in (p.strip() for p in (raw or "").split(",")):
        if not pair:
            continue
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"the label {pair!r} is not written key=value")
        labels[key.strip()] = value.strip()
    return labels
