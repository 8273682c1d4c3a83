"""A mirror version into one directory, whole or not at all.

The files are fetched from the version's manifest, several at once; a
`.complete` marker written last is the only sign that the set is whole, and it
is written only when every file's sha256 agrees with the manifest's.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from urllib.parse import quote

import requests
from django.conf import settings

from contracts.digest import sha256_file

from .download import check_space, fetch_file, fsync_dir, new_session, part_of
from .fetch_state import Verified, locked, read_verified, still_verified, write_verified
from .fetch_swarm import fetch_by_torrent
from .progress import Progress
from .sources import Entry, FetchError, MirrorChanged, NotReady, cache_path, read_manifest

log = logging.getLogger(__name__)

COMPLETE_MARKER = ".complete"
# How long a node asks the mirror about a set it already holds before it uses what it has.
CHECK_TIMEOUT = (3, 10)
# Rounds of "read the manifest, fetch what is missing" when files change on the mirror under the fetch.
ROUNDS = 20


def fetch_set(source: str, cache: Path, progress: Progress, parallel: int) -> Path:
    directory = cache_path(source, cache)
    # A complete set is marked by a file written last. Checking for the
    # directory alone would treat an interrupted download as finished, which is
    # exactly the failure the marker exists to prevent.
    marker = directory / COMPLETE_MARKER
    session = new_session(source)
    if marker.exists() and _cached_set_holds(session, source, cache, directory):
        return _already_complete(directory, progress)
    with locked(cache, directory, progress):
        deadline = time.monotonic() + settings.FETCH_WAIT_S
        for _round in range(ROUNDS):
            entries = manifest_when_ready(session, source, progress, deadline)
            if marker.exists() and _holds(cache, directory, entries):
                return _already_complete(directory, progress)
            directory.mkdir(parents=True, exist_ok=True)
            try:
                _fetch_round(session, source, cache, directory, entries, progress, parallel)
            except MirrorChanged as changed:
                log.info("%s; reading %s again", changed, source)
                continue
            break
        else:
            raise FetchError(f"{source} kept changing on the mirror while it was fetched; fetch again later")
    progress.complete()
    return directory


def manifest_when_ready(
    session: requests.Session, source: str, progress: Progress, deadline: float, timeout=None
) -> list[Entry]:
    """The version's manifest once the mirror says it is whole, waiting on its Retry-After meanwhile.

    While it waits, a dropped connection (the listener closing an idle kept-alive one, a
    restart) is asked again a few times rather than ending a wait of hours.
    """
    waited, dropped = False, 0
    while True:
        try:
            # Once the listener has said "not ready", a dropped connection is asked again, not answered
            # from the copy in Redis: that copy is of the version as it was before it changed.
            return read_manifest(session, source, **({"timeout": timeout} if timeout else {}), kept_copy=not waited)
        except NotReady as not_ready:
            waited, dropped = True, 0
            if time.monotonic() + not_ready.retry_after > deadline:
                raise FetchError(
                    f"{not_ready}; a fetch waits at most {settings.FETCH_WAIT_S} s (LLMGW_FETCH_WAIT_S) and "
                    "this one has",
                    transient=True,
                ) from None
            until = time.monotonic() + not_ready.retry_after
            while time.monotonic() < until:
                # Said every second: a cancel from staff arrives with an update.
                progress.not_ready(str(not_ready))
                time.sleep(min(1.0, max(0.0, until - time.monotonic())))
        except FetchError as error:
            if not (waited and error.transient and dropped < 3 and time.monotonic() < deadline):
                raise
            dropped += 1
            time.sleep(1.0)


def _cached_set_holds(session: requests.Session, source: str, cache: Path, directory: Path) -> bool:
    """Whether a set marked complete is still the version the mirror offers: one small request, no hashing.

    Checked every time the set is asked for (an engine start, a fetch): what was verified
    at `.complete` (each file's size, mtime and sha256) is compared with the manifest. A
    set from before hashes were kept, or one the mirror has changed since (a file whose
    copy paused and went on), is not taken as whole; the locked path then finds what is
    wrong and fetches only that. A mirror that cannot say (away, not ready, refusing)
    leaves the node with what it verified last.
    """
    try:
        entries = read_manifest(session, source, timeout=CHECK_TIMEOUT)
    except FetchError as error:
        log.info("using the cached %s as it is: %s", source, error)
        return True
    return _holds(cache, directory, entries)


def _holds(cache: Path, directory: Path, entries: list[Entry]) -> bool:
    verified = read_verified(cache, directory)
    if set(verified) != {e.name for e in entries}:
        return False
    return all(still_verified(directory / e.name, verified.get(e.name), e.bytes, e.sha256) for e in entries)


def _already_complete(directory: Path, progress: Progress) -> Path:
    files = [p for p in directory.iterdir() if not p.name.startswith(".") and p.is_file()]
    progress.already_complete(bytes_total=sum(p.stat().st_size for p in files), files_total=len(files))
    return directory


def _fetch_round(
    session: requests.Session,
    source: str,
    cache: Path,
    directory: Path,
    entries: list[Entry],
    progress: Progress,
    parallel: int,
) -> None:
    verified: Verified = {}
    todo = _begin(source, cache, directory, entries, progress, verified)
    marker = directory / COMPLETE_MARKER
    if marker.exists():
        # No longer whole: a kill from here on must not leave it marked so.
        marker.unlink()
        fsync_dir(directory)
    _drop_strays(directory, entries)
    # Through the node's libtorrent session when the mirror offers the set as a torrent; over
    # HTTP, file by file, when it does not (an older mirror, another server).
    by_torrent = (
        bool(todo)
        and getattr(entries, "torrent", None)
        and getattr(settings, "FETCH_TORRENT", True)
        and fetch_by_torrent(session, source, cache, directory, entries, todo, progress, verified)
    )
    if not by_torrent:
        _fetch_files(session, source, cache, directory, todo, progress, parallel, verified)
    _mark_complete(source, cache, directory, entries, verified)


def _already_there(path: Path, entry: Entry, recorded: tuple[int, int, str] | None) -> bool:
    """Whether the file is already the manifest's: by what was verified of it, else by its sha256."""
    if still_verified(path, recorded, entry.bytes, entry.sha256):
        return True
    try:
        if path.stat().st_size != entry.bytes:
            return False
    except OSError:
        return False
    return not entry.sha256 or sha256_file(path) == entry.sha256


def _begin(
    source: str, cache: Path, directory: Path, entries: list[Entry], progress: Progress, verified: Verified
) -> list[Entry]:
    """The files still to fetch; refuses up front when they would not fit, and starts the progress."""
    recorded = read_verified(cache, directory)
    todo, bytes_done = [], 0
    for entry in entries:
        path = directory / entry.name
        if _already_there(path, entry, recorded.get(entry.name)):
            bytes_done += entry.bytes
            if entry.sha256:
                verified[entry.name] = (entry.bytes, path.stat().st_mtime_ns, entry.sha256)
        else:
            todo.append(entry)
    missing = 0
    for entry in todo:
        part = part_of(directory / entry.name)
        have = part.stat().st_size if part.exists() else 0
        have = have if have <= entry.bytes else 0
        bytes_done += have
        missing += entry.bytes - have
    check_space(source, directory, missing)
    progress.begin(
        bytes_total=sum(e.bytes for e in entries),
        files_total=len(entries),
        bytes_done=bytes_done,
        files_done=len(entries) - len(todo),
    )
    return todo


def _drop_strays(directory: Path, entries: list[Entry]) -> None:
    """Files the version no longer has: an engine handed the directory would load them too."""
    keep = {e.name for e in entries} | {part_of(Path(e.name)).name for e in entries}
    for path in directory.iterdir():
        if not path.name.startswith(".") and path.name not in keep and path.is_file():
            path.unlink()


def _fetch_files(
    session: requests.Session,
    source: str,
    cache: Path,
    directory: Path,
    todo: list[Entry],
    progress: Progress,
    parallel: int,
    verified: Verified,
) -> None:
    """Several files at once: one TCP stream rarely fills a fast link, and shards are independent.

    The first failure stops the others between chunks, and is raised.
    """
    stop = threading.Event()

    def one(entry: Entry) -> None:
        target = directory / entry.name
        # Its own lock too: a single-file fetch of this very file lands on the same path.
        with locked(cache, target, progress, cancel=stop):
            if not _already_there(target, entry, None):
                progress.file_started(entry.name)
                # Encoded whole: a name is a name, not a path or an address (`r%41.bin` is not
                # `rA.bin`, and `#` or `?` would end the path).
                url = source + quote(entry.name, safe="")
                fetch_file(session, url, target, cache, progress, entry, cancel=stop)
                progress.file_done(entry.name)
            # The download checked the sha256 before the rename (or the file already had it).
            if entry.sha256:
                verified[entry.name] = (entry.bytes, target.stat().st_mtime_ns, entry.sha256)

    with ThreadPoolExecutor(max_workers=max(1, parallel), thread_name_prefix="fetch") as pool:
        futures = [pool.submit(one, entry) for entry in todo]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        errors = [f.exception() for f in done if f.exception() is not None]
        if errors:
            stop.set()
            for f in futures:
                f.cancel()
            wait(futures)
            raise errors[0]


def _mark_complete(source: str, cache: Path, directory: Path, entries: list[Entry], verified: Verified) -> None:
    """Whole set or nothing: every file's sha256 has agreed, and the marker is written last, atomically."""
    for entry in entries:
        target = directory / entry.name
        if not target.exists() or target.stat().st_size != entry.bytes:
            raise FetchError(f"{source}: {entry.name} is missing after the fetch; fetch again")
        if not entry.sha256:
            # A size is not a proof: a file still being copied in has a size too.
            raise FetchError(
                f"{source}: the mirror gives no sha256 for {entry.name}, and a set is marked whole only when every "
                "file's sha256 agrees with the mirror's; the files are kept and the next attempt checks them again",
                transient=True,
            )
        if not still_verified(target, verified.get(entry.name), entry.bytes, entry.sha256):
            raise MirrorChanged(f"{source}: {entry.name} was not verified against the manifest")
    write_verified(cache, directory, {e.name: verified[e.name] for e in entries})
    tmp = directory / (COMPLETE_MARKER + ".tmp")
    tmp.write_text(source + "\n")
    os.replace(tmp, directory / COMPLETE_MARKER)
    fsync_dir(directory)
