"""A mirror version into one directory, whole or not at all.

The files are fetched from the version's manifest, several at once; a
`.complete` marker written last is the only sign that the set is whole.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from urllib.parse import quote

import requests

from contracts.digest import sha256_file

from .download import check_space, fetch_file, fsync_dir, new_session, part_of
from .fetch_state import locked
from .progress import Progress
from .sources import Entry, FetchError, cache_path, read_manifest

COMPLETE_MARKER = ".complete"


def fetch_set(source: str, cache: Path, progress: Progress, parallel: int) -> Path:
    directory = cache_path(source, cache)
    # A complete set is marked by a file written last. Checking for the
    # directory alone would treat an interrupted download as finished, which is
    # exactly the failure the marker exists to prevent.
    marker = directory / COMPLETE_MARKER
    if marker.exists():
        return _already_complete(directory, progress)
    session = new_session(source)
    with locked(cache, directory, progress):
        if marker.exists():
            return _already_complete(directory, progress)
        entries = read_manifest(session, source)
        directory.mkdir(parents=True, exist_ok=True)
        todo = _begin(source, directory, entries, progress)
        _fetch_files(session, source, cache, directory, todo, progress, parallel)
        _mark_complete(source, directory, entries)
    progress.complete()
    return directory


def _already_complete(directory: Path, progress: Progress) -> Path:
    files = [p for p in directory.iterdir() if not p.name.startswith(".") and p.is_file()]
    progress.already_complete(bytes_total=sum(p.stat().st_size for p in files), files_total=len(files))
    return directory


def _already_there(path: Path, entry: Entry) -> bool:
    try:
        if path.stat().st_size != entry.bytes:
            return False
    except OSError:
        return False
    return not entry.sha256 or sha256_file(path) == entry.sha256


def _begin(source: str, directory: Path, entries: list[Entry], progress: Progress) -> list[Entry]:
    """The files still to fetch; refuses up front when they would not fit, and starts the progress."""
    todo, bytes_done = [], 0
    for entry in entries:
        if _already_there(directory / entry.name, entry):
            bytes_done += entry.bytes
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


def _fetch_files(
    session: requests.Session,
    source: str,
    cache: Path,
    directory: Path,
    todo: list[Entry],
    progress: Progress,
    parallel: int,
) -> None:
    """Several files at once: one TCP stream rarely fills a fast link, and shards are independent.

    The first failure stops the others between chunks, and is raised.
    """
    stop = threading.Event()

    def one(entry: Entry) -> None:
        target = directory / entry.name
        # Its own lock too: a single-file fetch of this very file lands on the same path.
        with locked(cache, target, progress, cancel=stop):
            if _already_there(target, entry):
                return
            progress.file_started(entry.name)
            # Encoded whole: a name is a name, not a path or an address (`r%41.bin` is not
            # `rA.bin`, and `#` or `?` would end the path).
            url = source + quote(entry.name, safe="")
            fetch_file(session, url, target, cache, progress, entry, cancel=stop)
            progress.file_done(entry.name)

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


def _mark_complete(source: str, directory: Path, entries: list[Entry]) -> None:
    """Whole set or nothing: every file is checked again, and the marker is written last, atomically."""
    for entry in entries:
        target = directory / entry.name
        if not target.exists() or target.stat().st_size != entry.bytes:
            raise FetchError(f"{source}: {entry.name} is missing after the fetch; fetch again")
    tmp = directory / (COMPLETE_MARKER + ".tmp")
    tmp.write_text(source + "\n")
    os.replace(tmp, directory / COMPLETE_MARKER)
    fsync_dir(directory)
