"""Whether a version may be offered: whole, settled and hashed, or not at all (issue 21).

The mirror is a place operators copy files into by hand, with `cp` or `rsync` or a
download left running. A file still being written looks like any other file; served,
it reaches a node as a truncated model marked whole, and stays that way. So a version
is servable only when every file has stopped changing (`LLMGW_MIRROR_SETTLE_S`) and has
a sha256 for exactly the size and mtime it has now. Otherwise the manifest says why,
with a status (503) and a `Retry-After` the nodes wait on, and the serve page and
placement do not offer it.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from urllib.parse import unquote

from django.conf import settings
from django.db import DatabaseError, connections

from . import disk, scan, torrent
from .models import MirrorFile

log = logging.getLogger(__name__)

# What the byte listener expects to hash in a second, to tell a node when to ask again.
HASH_RATE = 200e6
# The longest a node is told to wait before asking again: a copy that ends sooner is seen sooner.
MAX_RETRY_S = 60


@dataclass
class Readiness:
    """A version as the manifest gives it: its hashes, and why it is not ready ("" when it is)."""

    hashes: dict[str, str] = field(default_factory=dict)  # name -> sha256, for the files as they are now
    problem: str = ""
    retry_after: int = 0
    # The v2 info-hash of the version's torrent, once it is computed for exactly these files.
    info_hash: str = ""

    @property
    def ready(self) -> bool:
        return not self.problem


def being_written(files: Iterable[disk.DiskFile], now: float | None = None) -> tuple[str, int] | None:
    """(the sentence, seconds to wait) for the youngest file still changing, or None when all have settled.

    "Settled" is by the clock: modified at least LLMGW_MIRROR_SETTLE_S ago. A modification
    time far in the future is not taken for a copy under way (a file given a date by hand,
    `touch -d`); a clock a little ahead is.
    """
    settle = settings.MIRROR_SETTLE_S
    if settle <= 0:
        return None
    now = time.time() if now is None else now
    youngest = None
    for f in files:
        age = now - f.mtime_ns / 1e9
        if abs(age) < settle and (youngest is None or age < youngest[1]):
            youngest = (f.name, age)
    if youngest is None:
        return None
    name, age = youngest
    wait = max(1, math.ceil(settle - max(age, 0)))
    when = f"{age:.0f} s ago" if age >= 0.5 else "just now"
    return (
        f"{name} is still being written (it changed {when}; the mirror takes a file as whole once it has "
        f"not changed for {settle} s)",
        wait,
    )


def not_ready_on_disk(model: str, version: str, indexed: dict[str, tuple[int, int]] | None = None) -> str:
    """Why a version may not be offered now, from the disk alone (no hashing): "" when it may.

    `indexed` (name -> (bytes, mtime_ns)) is what the serve page's plan was made from:
    a file that moved since then is being written or was replaced, and the plan is stale.
    """
    files = disk.version_files(model, version)
    if files is None:
        return f"{model}/{version} is not in the mirror's directory"
    written = being_written(files)
    if written is not None:
        return written[0]
    if indexed is not None:
        now = {f.name: (f.bytes, f.mtime_ns) for f in files}
        for name in sorted(set(now) | set(indexed)):
            if name not in now:
                return f"{name} is gone from the mirror's directory since its last scan"
            if name not in indexed:
                return f"{name} appeared in the mirror's directory since its last scan"
            if now[name] != indexed[name]:
                return f"{name} changed since the mirror's last scan (it is being written, or was replaced)"
    return ""


def prepare(model: str, version: str, files: list[disk.DiskFile]) -> Readiness:
    """The manifest's view of a version now: index it, hash what is small enough here, say what is missing.

    Hashed once per content, as the scan's hashes are (`scan.hash_file`, claimed, kept
    against size and mtime): the first node to ask for a version of small files gets
    their hashes at once; a version of large ones is hashed in the background while the
    nodes are told to come back.
    """
    written = being_written(files)
    try:
        hashes = _known(model, version, files)
        if written is not None:
            return Readiness(hashes, *written)
        missing = [f for f in files if f.name not in hashes]
        if missing:
            scan.index_version(model, version)
            ids = _file_ids(model, version, {f.name for f in missing})
            inline, budget = [], settings.MIRROR_HASH_INLINE_BYTES
            for f in missing:
                if f.bytes <= budget:
                    inline.append(f)
                    budget -= f.bytes
            for f in inline:
                if f.name in ids:
                    scan.hash_file(ids[f.name])
            later = [ids[f.name] for f in missing if f not in inline and f.name in ids]
            if later:
                _in_background(lambda: [scan.hash_file(i) for i in later])
            hashes = _known(model, version, files)
    except DatabaseError:
        return Readiness({}, "the mirror's index cannot be read, so the files' sha256 are not known", 10)
    unhashed = [f for f in files if f.name not in hashes]
    if not unhashed:
        try:
            return Readiness(hashes, info_hash=_torrent_now_or_later(model, version, files, hashes))
        except DatabaseError:
            return Readiness(hashes)
    changed = _changed_since(model, version, unhashed)
    if changed:
        return Readiness(hashes, f"{changed} changed while it was being hashed: it is still being written", 1)
    left = sum(f.bytes for f in unhashed)
    wait = min(MAX_RETRY_S, max(1, math.ceil(left / HASH_RATE)))
    names = ", ".join(f.name for f in unhashed[:3]) + (" and more" if len(unhashed) > 3 else "")
    return Readiness(
        hashes,
        f"the mirror is still hashing {names} ({len(files) - len(unhashed)} of {len(files)} files hashed); "
        "a version is served only with a sha256 for every file",
        wait,
    )


def _torrent_now_or_later(model: str, version: str, files: list[disk.DiskFile], hashes: dict[str, str]) -> str:
    """The torrent's info-hash when it is stored for these files; computed here when the version is small
    enough to read inside the request, else in the background (the manifest offers it once it is there)."""
    triples = [(f.name, f.bytes, hashes[f.name]) for f in files]
    row = torrent.current(model, version, triples)
    if row is not None:
        return row.torrent_info_hash
    if sum(f.bytes for f in files) <= settings.MIRROR_HASH_INLINE_BYTES:
        return _blocking(lambda: torrent.ensure(model, version, triples))
    _in_background(lambda: torrent.ensure(model, version, triples))
    return ""


def torrent_when_hashed(model: str, version: str) -> str:
    """After a file is hashed (the scan's hash task): the version's torrent, once every file has its sha256."""
    files = disk.version_files(model, version)
    if not files or being_written(files) is not None:
        return ""
    hashes = _known(model, version, files)
    if len(hashes) != len(files):
        return ""
    return torrent.ensure(model, version, [(f.name, f.bytes, hashes[f.name]) for f in files])


def _blocking(work: Callable[[], str]) -> str:
    """`work()` off gevent's hub when under the byte listener (it reads files), else here."""
    try:
        from gevent import monkey

        if monkey.is_module_patched("threading"):
            import gevent

            def run() -> str:
                try:
                    return work()
                finally:
                    connections.close_all()

            return gevent.get_hub().threadpool.apply(run)
    except ImportError:
        pass
    return work()


def _changed_since(model: str, version: str, files: list[disk.DiskFile]) -> str:
    """The first of `files` whose size or mtime is not what it was, or ""."""
    now = {g.name: (g.bytes, g.mtime_ns) for g in disk.version_files(model, version) or ()}
    return next((f.name for f in files if now.get(f.name) != (f.bytes, f.mtime_ns)), "")


def _known(model: str, version: str, files: list[disk.DiskFile]) -> dict[str, str]:
    """name -> sha256 from the index, only for a file whose size and mtime are the ones that were hashed."""
    known = scan.known_hashes(model, version)
    out = {}
    for f in files:
        entry = known.get(f.name)
        if entry and entry[0] == f.bytes and entry[1] == f.mtime_ns:
            out[f.name] = entry[2]
    return out


def _file_ids(model: str, version: str, names: set[str]) -> dict[str, int]:
    rows = MirrorFile.objects.filter(version__model=model, version__version=version, name__in=names)
    return dict(rows.values_list("name", "pk"))


def _in_background(work: Callable[[], object]) -> None:
    """Run `work` in a real thread (gevent's pool under the byte listener), its database connection closed after."""

    def run() -> None:
        try:
            work()
        except Exception:
            log.exception("hashing in the background failed")
        finally:
            connections.close_all()

    try:
        from gevent import monkey

        if monkey.is_module_patched("threading"):
            import gevent

            gevent.get_hub().threadpool.spawn(run)
            return
    except ImportError:
        pass
    threading.Thread(target=run, name="mirror-hash", daemon=True).start()


def source_being_written(source: str, byte_base: str) -> str:
    """For placement: the sentence when a source on this byte listener names a version with a file
    still being written, else "" (also for a source elsewhere, or a version not on this disk)."""
    if not source.startswith(byte_base):
        return ""
    parts = [unquote(p) for p in source[len(byte_base) :].split("/")]
    if len(parts) < 2:
        return ""
    files = disk.version_files(parts[0], parts[1])
    written = being_written(files or ())
    return f"the mirror's {parts[0]}/{parts[1]}/ is not ready: {written[0]}" if written else ""
