"""The byte listener opens only a regular file inside the mirror, and never waits on one (issue 34, item 8).

A real byte listener (gunicorn + gevent). The mirror is a directory filled by hand, so what
lies in it is not to be trusted: a FIFO, where opening it blocks until something writes;
a file swapped for a link to one outside the mirror between the listener's check and its
open; and a version whose manifest hashes a few hundred MiB, which on the event loop held
every other connection of the worker.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from .support.mirror import put
from .support.processes import as_node, start_byte_listener
from .support.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

WEIGHTS = bytes(range(256)) * 64


def test_a_fifo_in_the_mirror_is_answered_404_at_once_and_holds_up_no_download(byte_listener, mirror_root):
    directory = put(mirror_root, "m", "v1", {"a.bin": WEIGHTS})
    fifo = directory / "pipe.bin"
    os.mkfifo(fifo)
    try:
        with ThreadPoolExecutor(2) as pool:
            asked = pool.submit(as_node.get, byte_listener + "m/v1/pipe.bin", timeout=30)
            # Meanwhile, from the same worker, a download: it is not waiting on the FIFO's writer.
            assert as_node.get(byte_listener + "m/v1/a.bin", timeout=10).content == WEIGHTS
            answer = asked.result(timeout=30)
        assert answer.status_code == 404 and "nothing here" in answer.json()["error"]
    finally:
        # The old listener sat in open() on it: a writer lets it go, so the session's listener lives on.
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass  # nobody was reading it


def test_a_file_swapped_for_a_link_to_a_secret_outside_the_mirror_is_never_served(byte_listener, mirror_root, tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"the key to everything" * 100)
    directory = put(mirror_root, "m", "v1", {"a.bin": WEIGHTS})
    regular, link = directory / ".regular", directory / ".link"
    stop = threading.Event()

    def swap() -> None:
        # a.bin is, in turn, the mirror's file and a link out of the mirror: each an atomic rename.
        while not stop.is_set():
            regular.write_bytes(WEIGHTS)
            os.replace(regular, directory / "a.bin")
            link.unlink(missing_ok=True)
            link.symlink_to(secret)
            os.replace(link, directory / "a.bin")

    swapper = threading.Thread(target=swap, daemon=True)
    swapper.start()
    answers = []
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and len(answers) < 1500:
            answers.append(as_node.get(byte_listener + "m/v1/a.bin", timeout=10))
    finally:
        stop.set()
        swapper.join()
    leaked = [r for r in answers if b"the key to everything" in r.content]
    assert not leaked, f"{len(leaked)} of {len(answers)} answers were the file outside the mirror"
    statuses = {r.status_code for r in answers}
    assert statuses <= {200, 404}, statuses
    assert 200 in statuses, "the swap never left the mirror's own file in place: nothing was tested"
    assert all(r.content == WEIGHTS for r in answers if r.status_code == 200)


def read_bytes_of(pid: int) -> int:
    """Bytes the process has read so far, page cache and all (/proc/PID/io's rchar)."""
    for line in open(f"/proc/{pid}/io"):
        if line.startswith("rchar:"):
            return int(line.split()[1])
    return 0


def test_a_manifest_hashing_gigabytes_does_not_hold_up_another_download(mirror_root, tmp_path, fleet_node):
    # A listener that hashes up to 4 GiB inside a manifest request, so that the hashing lasts (3 GiB, sparse).
    process, url = start_byte_listener(mirror_root, tmp_path, LLMGW_MIRROR_HASH_INLINE_BYTES=str(4 << 30))
    try:
        put(mirror_root, "m", "v1", {"a.bin": WEIGHTS})
        big = mirror_root / "big" / "v1" / "weights.bin"
        big.parent.mkdir(parents=True)
        size = 3 << 30
        with open(big, "wb") as f:
            f.truncate(size)
        then = time.time_ns() - 60 * 10**9
        os.utime(big, ns=(then, then))
        children = open(f"/proc/{process.popen.pid}/task/{process.popen.pid}/children").read().split()
        assert len(children) == 1, children  # LLMGW_BYTES_WORKERS=1 in the tests
        worker = int(children[0])
        with ThreadPoolExecutor(1) as pool:
            before = read_bytes_of(worker)
            manifest = pool.submit(as_node.get, url + "big/v1/", timeout=600)
            wait_until(
                lambda: read_bytes_of(worker) - before > 64 << 20 or manifest.done(),
                timeout=60,
                what="the byte listener to start hashing big/v1",
            )
            # Asked while the worker hashes, and answered while it still does: the hashing is not on the event loop.
            assert as_node.get(url + "m/v1/a.bin", timeout=120).content == WEIGHTS
            read = read_bytes_of(worker) - before
            assert read < size, f"the download was answered once all {read:,} bytes were hashed, not before"
            answer = manifest.result(timeout=600)
        assert answer.status_code == 200, answer.text
        assert answer.json()["files"][0]["sha256"]
    finally:
        process.stop()
