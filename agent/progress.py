"""Progress of a fetch: what a node is doing with a source, told to whoever waits on it.

Published to Redis under the node's own prefix (contracts.keys), one field per
source's own address (a version's address for a set), because that is what
everything waiting on it asked for: progress under each file's URL reaches nobody.
A node writes only its own keys, so two nodes never overwrite each other.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time

import redis
from django.conf import settings
from tqdm import tqdm

from contracts.progress import KEEP_S, STATES, cancel_key, progress_key, progress_sources_key
from contracts.redis_client import redis_client as pooled_client

log = logging.getLogger(__name__)

# A few updates a second: enough for a live bar, few enough that a fast local
# fetch does not spend its time talking to Redis.
MIN_INTERVAL_S = 0.25


class Cancelled(Exception):
    """Staff cancelled this fetch; raised from a progress update so the fetch stops between chunks."""


class Progress:
    """What a fetch reports, and when. This one keeps the numbers and tells nobody.

    Thread-safe: a set's files are fetched in parallel and all report here.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.state = "queued"
        self.bytes_done = 0
        self.bytes_total = 0
        self.files_done = 0
        self.files_total = 0
        self.current_file = ""
        self.error = ""
        # Why the fetch is waiting on the mirror ("" when it is not): the version is not whole yet.
        self.waiting_for = ""
        # Where a set's bytes came from when it goes through the node's libtorrent session, and,
        # when nothing arrives from anyone, the sentence naming every source that stalled.
        self.bytes_from_peers = 0
        self.bytes_from_mirror = 0
        self.stalled = ""
        self.started = time.time()
        self._rate_mark = self._begin_mark = (time.monotonic(), 0)
        self.rate = 0.0

    # --- what the fetch calls ------------------------------------------------

    def begin(self, *, bytes_total: int, files_total: int, bytes_done: int = 0, files_done: int = 0) -> None:
        with self._lock:
            self.bytes_total, self.files_total = bytes_total, files_total
            self.bytes_done, self.files_done = bytes_done, files_done
            self.error = ""
            self._rate_mark = self._begin_mark = (time.monotonic(), bytes_done)
        self.set_state("fetching")

    def file_started(self, name: str) -> None:
        with self._lock:
            self.current_file = name
        self._publish(force=True)

    def advanced(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_done += nbytes
        self._publish(force=False)

    def restarted(self, nbytes_discarded: int) -> None:
        """A part was thrown away (the server ignored Range, the file changed)."""
        with self._lock:
            self.bytes_done = max(0, self.bytes_done - nbytes_discarded)
        self._publish(force=False)

    def file_done(self, name: str) -> None:
        with self._lock:
            self.files_done += 1
        self._publish(force=True)

    def swarm(self, status: dict) -> None:
        """A status of the node's libtorrent session (contracts.swarm.SwarmStatus, as a dict)."""
        stalled = status.get("why", "") if status.get("all_stalled") else ""
        with self._lock:
            self.bytes_done = status["bytes_done"]
            self.bytes_from_peers = status["bytes_from_peers"]
            self.bytes_from_mirror = status["bytes_from_web_seeds"]
            changed, self.stalled = stalled != self.stalled, stalled
        self._publish(force=changed)

    def waiting(self) -> None:
        """Called while another fetch of the same thing holds its lock.

        Publishes nothing: the fetch holding the lock is the one reporting under
        this address, and a second voice would overwrite its numbers.
        """

    def not_ready(self, sentence: str) -> None:
        """The mirror says the version is not whole yet: queued, saying why, until it is."""
        with self._lock:
            self.state, self.waiting_for = "queued", sentence
        self._publish(force=True)

    def set_state(self, state: str) -> None:
        assert state in STATES, state
        with self._lock:
            self.state = state
            if state != "queued":
                self.waiting_for = ""
        self._publish(force=True)

    def failed(self, sentence: str) -> None:
        with self._lock:
            self.state, self.error = "failed", sentence
        self._publish(force=True)

    def already_complete(self, *, bytes_total: int, files_total: int) -> None:
        """Nothing was left to fetch.

        Reported with its real totals: a second fetch of a finished set must not
        publish zeros over the numbers of the one that did the work.
        """
        self.begin(bytes_total=bytes_total, files_total=files_total, bytes_done=bytes_total, files_done=files_total)
        self.complete()

    def complete(self) -> None:
        with self._lock:
            self.state, self.current_file = "complete", ""
            self.bytes_done = max(self.bytes_done, self.bytes_total)
            self.files_done = self.files_total
        self._publish(force=True)

    # --- what is published ---------------------------------------------------

    def snapshot(self) -> dict:
        with self._lock:
            now = time.monotonic()
            mark_t, mark_b = self._rate_mark
            if now - mark_t >= 1.0:
                self.rate = max(0.0, (self.bytes_done - mark_b) / (now - mark_t))
                self._rate_mark = (now, self.bytes_done)
            elif not self.rate and now > self._begin_mark[0]:
                # Under a second in: the average so far, rather than a rate of nothing.
                self.rate = max(0.0, (self.bytes_done - self._begin_mark[1]) / (now - self._begin_mark[0]))
            return {
                "state": self.state,
                "bytes_done": self.bytes_done,
                "bytes_total": self.bytes_total,
                "files_done": self.files_done,
                "files_total": self.files_total,
                "current_file": self.current_file,
                "rate": round(self.rate),
                "error": self.error,
                "waiting_for": self.waiting_for,
                "bytes_from_peers": self.bytes_from_peers,
                "bytes_from_mirror": self.bytes_from_mirror,
                "stalled": self.stalled,
                "started": self.started,
                "updated": time.time(),
            }

    def _publish(self, force: bool) -> None:
        """Overridden by the publishers; the base keeps the numbers only."""


class Throttled(Progress):
    """Publishes at most every MIN_INTERVAL_S, except state changes, which always go out."""

    def __init__(self) -> None:
        super().__init__()
        self._last_sent = 0.0
        self._send_lock = threading.Lock()

    def _publish(self, force: bool) -> None:
        now = time.monotonic()
        if not force and now - self._last_sent < MIN_INTERVAL_S:
            return
        # One sender at a time; a thread that finds it busy skips this update
        # rather than queueing behind it, unless it carries a state change.
        if not self._send_lock.acquire(blocking=force):
            return
        try:
            self._last_sent = now
            self.send(self.snapshot())
        finally:
            self._send_lock.release()

    def send(self, snapshot: dict) -> None:
        raise NotImplementedError


class RedisProgress(Throttled):
    """A node's progress on one source, in Redis under the node's prefix, in the field of the source's address.

    Also where a cancel from staff arrives: a flag checked with each update, so
    a fetch stops between chunks rather than being killed mid-write.
    """

    def __init__(self, client, source: str, node: str) -> None:
        self.client, self.source, self.node = client, source, node
        self._said_unreachable = False
        super().__init__()

    def waiting(self) -> None:
        now = time.monotonic()
        if now - self._last_sent >= MIN_INTERVAL_S:
            self._last_sent = now
            try:
                cancelled = self.client.exists(cancel_key(self.node, self.source))
            except redis.RedisError:
                return
            if cancelled:
                raise Cancelled(f"the fetch of {self.source} onto {self.node} was cancelled by staff")

    def send(self, snapshot: dict) -> None:
        snapshot = dict(snapshot, source=self.source, node=self.node)
        key, sources = progress_key(self.node), progress_sources_key(self.node)
        pipe = self.client.pipeline()
        pipe.hset(key, self.source, json.dumps(snapshot))
        pipe.zadd(sources, {self.source: snapshot["updated"]})
        pipe.expire(key, KEEP_S)
        pipe.expire(sources, KEEP_S)
        pipe.exists(cancel_key(self.node, self.source))
        try:
            *_, cancelled = pipe.execute()
            if snapshot["state"] in ("complete", "failed"):
                self.forget_old(snapshot["updated"] - KEEP_S)
        except redis.RedisError as error:
            # Progress is a report, not the fetch: Redis away for a moment must
            # not fail an hour-long download. Said once, not on every chunk.
            if not self._said_unreachable:
                self._said_unreachable = True
                log.warning("progress of %s not published: %s", self.source, error)
            return
        self._said_unreachable = False
        if cancelled and snapshot["state"] not in ("complete", "failed"):
            raise Cancelled(f"the fetch of {self.source} onto {self.node} was cancelled by staff")

    def forget_old(self, before: float) -> None:
        """Drop the node's progress on sources nothing moved on since `before`: the hash is one per node, kept while it fetches."""
        sources = progress_sources_key(self.node)
        old = self.client.zrangebyscore(sources, "-inf", before)
        if old:
            pipe = self.client.pipeline()
            pipe.hdel(progress_key(self.node), *old)
            pipe.zrem(sources, *old)
            pipe.execute()


def redis_client() -> redis.Redis:
    """The node's Redis: a client on this process's one pool (contracts.redis_client)."""
    return pooled_client(settings.REDIS_URL)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


class TerminalProgress(Throttled):
    """A progress bar on a terminal (tqdm), for `manage.py fetch`."""

    def __init__(self, source: str, stream=None) -> None:
        self.source = source
        self.stream = stream or sys.stderr
        self._bar: tqdm | None = None
        self._said_waiting = False
        super().__init__()

    def waiting(self) -> None:
        if not self._said_waiting:
            self._said_waiting = True
            self.stream.write(f"waiting for another fetch of {self.source} on this host to finish\n")
            self.stream.flush()

    def not_ready(self, sentence: str) -> None:
        if sentence != self.waiting_for:
            self.stream.write(f"waiting: {sentence}\n")
            self.stream.flush()
        super().not_ready(sentence)

    def send(self, s: dict) -> None:
        if s["state"] == "queued":
            return  # nothing to draw while the mirror is not ready; not_ready said why
        if self._bar is None:
            if s["state"] == "failed" and not s["bytes_total"]:
                return  # failed before there was anything to show; the command prints the sentence
            # Throttled already paces the updates: tqdm draws each one it is given. Resumed bytes
            # are where the bar starts, not part of its rate.
            self._bar = tqdm(
                total=s["bytes_total"] or None,
                initial=s["bytes_done"],
                file=self.stream,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                mininterval=0,
                miniters=0,
            )
        bar = self._bar
        bar.total = s["bytes_total"] or None
        said = f"files {s['files_done']}/{s['files_total']} {s['state']}"
        if s["bytes_from_peers"] or s["bytes_from_mirror"]:
            said += f", {human_bytes(s['bytes_from_peers'])} from peers, {human_bytes(s['bytes_from_mirror'])} from the mirror"
        if s["stalled"]:
            said += f"; {s['stalled']}"
        bar.set_postfix_str(said, refresh=False)
        if s["bytes_done"] >= bar.n:
            bar.update(s["bytes_done"] - bar.n)
        else:
            bar.n = s["bytes_done"]  # a part thrown away: the bar goes back
            bar.refresh()
        if s["state"] in ("complete", "failed"):
            bar.close()
            self._bar = None
