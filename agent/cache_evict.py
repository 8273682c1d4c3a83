"""A node's disk, kept from only growing: weights no replica uses evicted oldest first, engine logs bounded.

Weights: a fetched set (a directory with its `.complete` marker) stays after its
replica stops, so that the same model starts again without a fetch. Above
LLMGW_NODE_CACHE_MAX_GB in all, or below LLMGW_NODE_CACHE_FREE_GB free on the cache's
disk, the sets that have gone unused longest are removed until the disk is within
both. Never a set a wanted replica's engine runs from, never one a fetch holds the
lock of (agent/fetch_state.py: the lock is held here while the set is removed, so no
fetch starts on it meanwhile), and never one used in the last GRACE_S: a fetch that
has just found a set complete registers its replica a moment later.

"Last used" is the marker's mtime: set when the fetch completed, and touched by
each pass while a replica runs from the set.

Engine logs: each replica's log (engine_state.state_dir/replica-N.log) is written by
its engine through a descriptor opened with O_APPEND, which cannot be reopened from
outside; past LOG_MAX_BYTES it is copied to .1 (older ones shifted, LOG_KEEP kept) and
truncated in place, as logrotate's copytruncate does. The engine's next write lands at
the new end of the emptied file.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from . import engine_state
from .fetch_set import COMPLETE_MARKER
from .fetch_state import STATE_DIR, _key

log = logging.getLogger(__name__)

GiB = 1 << 30
# A set found complete (or used) this recently is never evicted: see the module's docstring.
GRACE_S = 600.0
# How often the supervisor's thread looks at the disk.
EVERY_S = 60.0
LOG_MAX_BYTES = 50 << 20
LOG_KEEP = 3


@dataclass(frozen=True)
class Bounds:
    max_bytes: int = 0  # 0: no bound on the cache's size
    free_bytes: int = 0  # 0: no floor on the disk's free space


def complete_sets(cache: Path) -> list[Path]:
    """Every fetched set under the cache: directories holding the marker written last."""
    found = []
    for directory, subdirectories, files in os.walk(cache):
        here = Path(directory)
        if here == cache:
            # The fetches' locks and the engines' state are not weights.
            subdirectories[:] = [d for d in subdirectories if d not in (STATE_DIR, engine_state.state_dir(cache).name)]
        if COMPLETE_MARKER in files:
            found.append(here)
            subdirectories[:] = []  # a set holds no other set
    return found


def size_of(path: Path) -> int:
    total = 0
    for directory, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(directory, name)).st_blocks * 512
            except OSError:
                pass  # removed meanwhile
    return total


def in_use(cache: Path) -> list[Path]:
    """The weights of every replica this node is asked to run, as real paths."""
    replicas = engine_state.read_state(cache)["replicas"].values()
    return [Path(os.path.realpath(entry["weights"])) for entry in replicas if entry.get("weights")]


def evict(cache: Path, bounds: Bounds, now: float | None = None) -> list[Path]:
    """Remove unused sets, oldest use first, until the cache is within `bounds`; the sets removed."""
    cache = Path(cache)
    now = time.time() if now is None else now
    if not (bounds.max_bytes or bounds.free_bytes) or not cache.is_dir():
        return []
    used = in_use(cache)
    candidates = []
    sizes = {}
    for directory in complete_sets(cache):
        real = Path(os.path.realpath(directory))
        sizes[directory] = size_of(directory)
        if any(weights == real or real in weights.parents for weights in used):
            os.utime(directory / COMPLETE_MARKER)  # in use now: the newest of all
            continue
        last_used = (directory / COMPLETE_MARKER).stat().st_mtime
        if now - last_used >= GRACE_S:
            candidates.append((last_used, directory))
    total = sum(sizes.values())
    removed = []
    for _, directory in sorted(candidates):
        over = bounds.max_bytes and total > bounds.max_bytes
        short = bounds.free_bytes and shutil.disk_usage(cache).free < bounds.free_bytes
        if not (over or short):
            break
        if _remove_unless_fetched(cache, directory):
            total -= sizes[directory]
            removed.append(directory)
            log.info(
                "evicted %s (%.1f GiB, unused the longest) to keep the cache within its bounds",
                directory,
                sizes[directory] / GiB,
            )
    return removed


def _remove_unless_fetched(cache: Path, directory: Path) -> bool:
    state = cache / STATE_DIR
    state.mkdir(parents=True, exist_ok=True)
    fd = os.open(state / f"{_key(directory)}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a fetch holds it: being fetched (or checked) now
        # The marker first: a set half removed is never taken for whole.
        (directory / COMPLETE_MARKER).unlink(missing_ok=True)
        shutil.rmtree(directory, ignore_errors=True)
        return True
    finally:
        os.close(fd)


def rotate_logs(cache: Path, max_bytes: int = LOG_MAX_BYTES, keep: int = LOG_KEEP) -> list[Path]:
    """Each engine log past `max_bytes`: copied to .1 (.1 to .2, ..., `keep` kept) and emptied in place."""
    rotated = []
    for path in sorted(engine_state.state_dir(cache).glob("replica-*.log")):
        try:
            if path.stat().st_size <= max_bytes:
                continue
        except FileNotFoundError:
            continue
        for n in range(keep - 1, 0, -1):
            older = path.with_name(f"{path.name}.{n}")
            if older.exists():
                older.replace(path.with_name(f"{path.name}.{n + 1}"))
        shutil.copyfile(path, path.with_name(f"{path.name}.1"))
        os.chmod(path.with_name(f"{path.name}.1"), 0o600)  # as the log itself: the agent's alone
        os.truncate(path, 0)
        rotated.append(path)
    return rotated


def keep(cache: Path, bounds: Bounds, stop: threading.Event, every: float = EVERY_S) -> None:
    """The supervisor's thread: the cache within its bounds and the logs rotated, every `every` seconds."""
    while not stop.is_set():
        try:
            evict(cache, bounds)
            rotate_logs(cache)
        except Exception:
            log.exception("keeping the node's disk failed; tried again in %.0f s", every)
        stop.wait(every)
