"""A node's disk does not only grow (issue 41 item 10): unused weights evicted oldest first above the
cache's bounds, never a set in use or being fetched, and engine logs rotated while the engine writes.

On real files in a real cache layout: sets with their `.complete` marker, the engines'
state file as the supervisor keeps it, a fetch's lock held as agent/fetch_state.py holds
it, and an engine process (engines.spawn, as the supervisor starts one) writing its log.
"""

from __future__ import annotations

import fcntl
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from agent import cache_evict, engine_state, engines
from agent.cache_evict import Bounds, evict, rotate_logs
from agent.fetch_set import COMPLETE_MARKER
from agent.fetch_state import STATE_DIR, _key

from .support.waiting import wait_until

MiB = 1 << 20


def fetched_set(cache: Path, name: str, mib: int, used_ago_s: float) -> Path:
    """A whole set of `mib` MiB of real blocks under the cache, last used `used_ago_s` ago."""
    directory = cache / "127.0.0.1_8001" / name / "v1"
    directory.mkdir(parents=True)
    (directory / "model.gguf").write_bytes(os.urandom(mib * MiB))
    marker = directory / COMPLETE_MARKER
    marker.write_text("")
    when = time.time() - used_ago_s
    os.utime(marker, (when, when))
    return directory


def wanted(cache: Path, replica_id: int, weights: Path) -> None:
    engine_state.want(cache, replica_id, "llamacpp", f"http://127.0.0.1:8001/{replica_id}/v1/", weights, [], "m")


@pytest.fixture
def agent_cache(tmp_path) -> Path:
    found = tmp_path / "agent-cache"
    found.mkdir()
    return found


def test_unused_sets_go_oldest_first_until_the_cache_is_under_its_bound_and_a_set_in_use_stays(agent_cache):
    oldest_in_use = fetched_set(agent_cache, "running", 1, used_ago_s=9 * 3600)
    old = fetched_set(agent_cache, "old", 1, used_ago_s=5 * 3600)
    older = fetched_set(agent_cache, "older", 1, used_ago_s=7 * 3600)
    newer = fetched_set(agent_cache, "newer", 1, used_ago_s=3 * 3600)
    wanted(agent_cache, 1, oldest_in_use / "model.gguf")

    removed = evict(agent_cache, Bounds(max_bytes=int(2.5 * MiB)))

    assert removed == [older, old]
    assert not older.exists() and not old.exists()
    assert (oldest_in_use / "model.gguf").exists() and (newer / COMPLETE_MARKER).exists()
    # In use: touched, so once its replica stops it is the newest, not the first to go.
    assert time.time() - (oldest_in_use / COMPLETE_MARKER).stat().st_mtime < 60


def test_a_set_being_fetched_or_just_found_complete_is_never_evicted(agent_cache):
    fetching = fetched_set(agent_cache, "fetching", 1, used_ago_s=9 * 3600)
    just_found = fetched_set(agent_cache, "just-found", 1, used_ago_s=10)
    idle = fetched_set(agent_cache, "idle", 1, used_ago_s=3600)
    (agent_cache / STATE_DIR).mkdir(exist_ok=True)
    fd = os.open(agent_cache / STATE_DIR / f"{_key(fetching)}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as a fetch of that set holds it
    try:
        assert evict(agent_cache, Bounds(max_bytes=1)) == [idle]
    finally:
        os.close(fd)
    assert (fetching / "model.gguf").exists() and (just_found / "model.gguf").exists()
    # Its fetch over, it goes like any other.
    assert evict(agent_cache, Bounds(max_bytes=1)) == [fetching]


def test_a_free_space_floor_evicts_and_without_bounds_nothing_is_touched(agent_cache):
    only = fetched_set(agent_cache, "only", 1, used_ago_s=3600)
    assert evict(agent_cache, Bounds()) == []
    assert evict(agent_cache, Bounds(free_bytes=1)) == []  # a disk with a byte free is within a floor of one
    huge_floor = Bounds(free_bytes=1 << 62)  # more than any disk has free
    assert evict(agent_cache, huge_floor) == [only]


@pytest.mark.processes  # a stand-in engine writing its log (a Python child the collection cannot see)
def test_an_engines_log_is_rotated_while_it_writes_and_only_a_few_are_kept(agent_cache):
    log_path = engine_state.state_dir(agent_cache) / "replica-5.log"
    writer = (
        "import sys, time\n"
        "n = 0\n"
        "while True:\n"
        "    sys.stdout.write(f'line {n} ' + 'x' * 200 + '\\n'); sys.stdout.flush(); n += 1\n"
        "    time.sleep(0.001)\n"
    )
    engine = engines.spawn([sys.executable, "-c", writer], log_path, dict(os.environ))
    try:
        for _ in range(5):
            wait_until(lambda: log_path.stat().st_size > 64 * 1024, what="the engine to write 64 KiB")
            assert rotate_logs(agent_cache, max_bytes=32 * 1024, keep=3) == [log_path]
        # Its next lines land at the start of the emptied file, not after a hole as long as the old log.
        wait_until(lambda: log_path.stat().st_size > 0, what="the engine to write again")
        assert log_path.read_bytes().startswith(b"line ")
    finally:
        engines.stop_group(engine.pid, grace=2)
        engine.wait(timeout=10)
    kept = sorted(p.name for p in log_path.parent.glob("replica-5.log*"))
    assert kept == ["replica-5.log", "replica-5.log.1", "replica-5.log.2", "replica-5.log.3"]
    assert b"starting:" not in log_path.with_name("replica-5.log.1").read_bytes()  # the newest kept is the latest


def test_the_supervisors_thread_keeps_the_disk_until_it_is_told_to_stop(agent_cache):
    fetched_set(agent_cache, "gone", 1, used_ago_s=3600)
    stop = threading.Event()
    thread = threading.Thread(target=cache_evict.keep, args=(agent_cache, Bounds(max_bytes=1), stop, 0.05))
    thread.start()
    try:
        wait_until(lambda: not cache_evict.complete_sets(agent_cache), what="the unused set to be evicted")
    finally:
        stop.set()
        thread.join(timeout=10)
    assert not thread.is_alive()
