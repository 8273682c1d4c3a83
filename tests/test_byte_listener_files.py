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
from .support.processes import as_node
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
    statuses = {r.status_code for r in answers}
    assert statuses <= {200, 404}, statuses
    assert 200 in statuses, "the swap never left the mirror's own file in place: nothing was tested"
    leaked = [r for r in answers if b"the key to everything" in r.content]
    assert not leaked, f"{len(leaked)} of {len(answers)} answers were the file outside the mirror"
    assert all(r.content == WEIGHTS for r in answers if r.status_code == 200)


def read_bytes_of(pid: int) -> int:
    for line in open(f"/proc/{pid}/io"):
        if line.startswith("rchar:"):
            return int(line.split()[1])
    return 0


def worker_pid(byte_listener_process) -> int:
    process, _ = byte_listener_process
    children = open(f"/proc/{process.popen.pid}/task/{process.popen.pid}/children").read().split()
    assert len(children) == 1, children  # LLMGW_BYTES_WORKERS=1 in the tests
    return int(children[0])


def test_a_manifest_hashing_hundreds_of_mib_does_not_hold_up_another_download(
    byte_listener, byte_listener_process, mirror_root, settings
):
    put(mirror_root, "m", "v1", {"a.bin": WEIGHTS})
    big = bytes(range(256)) * (1 << 20)  # 256 MiB, the most a manifest hashes itself
    put(mirror_root, "big", "v1", {"weights.bin": big[: settings.MIRROR_HASH_INLINE_BYTES]})
    pid = worker_pid(byte_listener_process)
    with ThreadPoolExecutor(1) as pool:
        before = read_bytes_of(pid)
        manifest = pool.submit(as_node.get, byte_listener + "big/v1/", timeout=300)
        wait_until(
            lambda: read_bytes_of(pid) - before > 32 << 20 or manifest.done(),
            timeout=60,
            what="the byte listener to start hashing big/v1",
        )
        assert not manifest.done(), "the manifest was answered before a download could be asked beside it"
        # Asked while the worker hashes: answered before the manifest is.
        assert as_node.get(byte_listener + "m/v1/a.bin", timeout=60).content == WEIGHTS
        assert not manifest.done(), "the download waited for the hashing to end"
        answer = manifest.result(timeout=300)
    assert answer.status_code == 200, answer.text
    assert answer.json()["files"][0]["sha256"]
