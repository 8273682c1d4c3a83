"""Fetching weights from the mirror: one file resumable, a set whole or not at all.

Used by the node's worker (`agent.fetch`), the engine tasks and `manage.py fetch`,
so resume, verification, the .part rename and progress live in one place. What
an address names and what a manifest may say are in `agent.sources`; the names
callers use (`fetch_source`, `FetchError`, `cache_path`, `is_set`) are here too.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path

import requests

from contracts.digest import sha256_file

from .progress import Cancelled, Progress, human_bytes
from .sources import (  # noqa: F401 - the fetch module's contract: fetch_source and the names around it
    TIMEOUT,
    Entry,
    FetchError,
    cache_path,
    describe,
    is_remote,
    is_set,
    read_manifest,
    status_error,
)

CHUNK = 1 << 20
COMPLETE_MARKER = ".complete"
# Lock files and the validators of parts live here, never beside the weights:
# the set's directory is handed to an engine as it is.
STATE_DIR = ".fetch"


# --- locks ------------------------------------------------------------------------


@contextmanager
def _locked(cache: Path, target: Path, progress: Progress, cancel: threading.Event | None = None):
    """Hold the lock of one target (a file or a set) against every other fetch on this host.

    flock on a file under the cache: two tasks, two processes or two threads
    fetching the same thing take turns, and the second finds the work done.
    The kernel drops the lock when a process dies, so a SIGKILL never leaves it held.
    """
    state = Path(cache) / STATE_DIR
    state.mkdir(parents=True, exist_ok=True)
    fd = os.open(state / f"{_key(target)}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if cancel is not None and cancel.is_set():
                    raise FetchError("stopped") from None
                # Polled rather than blocking, so a cancel reaches a waiting fetch.
                progress.waiting()
                time.sleep(0.2)
        yield
    finally:
        os.close(fd)


def _key(target: Path) -> str:
    # From the real path: a fetch given the cache as a relative path or through a
    # symlink must take the same lock as one given it any other way.
    return hashlib.sha256(os.path.realpath(target).encode()).hexdigest()[:32]


def _meta_path(cache: Path, target: Path) -> Path:
    return Path(cache) / STATE_DIR / f"{_key(target)}.json"


def _read_validator(cache: Path, target: Path) -> dict:
    try:
        return json.loads(_meta_path(cache, target).read_text())
    except (OSError, ValueError):
        return {}


def _write_validator(cache: Path, target: Path, etag: str, last_modified: str, total: int | None) -> None:
    _meta_path(cache, target).write_text(json.dumps({"etag": etag, "last_modified": last_modified, "total": total}))


# --- one file -----------------------------------------------------------------------


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _part_of(target: Path) -> Path:
    return target.with_name(target.name + ".part")


def _content_range_total(header: str | None) -> tuple[int | None, int | None]:
    """(start, total) from `bytes a-b/total` or `bytes */total`."""
    m = re.fullmatch(r"\s*bytes\s+(?:(\d+)-\d+|\*)/(\d+|\*)\s*", header or "")
    if not m:
        return None, None
    start = int(m.group(1)) if m.group(1) is not None else None
    total = int(m.group(2)) if m.group(2) != "*" else None
    return start, total


def _finish(url: str, part: Path, target: Path, total: int, entry: Entry | None, progress: Progress) -> None:
    """Rename a part into place, only when it is whole: its size, and its sha256 where known."""
    size = part.stat().st_size
    if size > total:
        # Longer than the file: no later attempt could make it right by appending.
        part.unlink()
        raise FetchError(
            f"{url} gave more bytes ({size:,}) than the file has ({total:,}); the next attempt starts over"
        )
    if size != total:
        raise FetchError(
            f"{url} gave {size:,} bytes where {total:,} were expected; the part is kept for the next attempt",
            transient=True,
        )
    if entry is not None and entry.bytes != total:
        part.unlink()
        raise FetchError(
            f"{url} is {total:,} bytes but the mirror's manifest said {entry.bytes:,}: the file changed on the "
            "mirror during the fetch; fetch again",
            transient=True,
        )
    if entry is not None and entry.sha256:
        progress.set_state("verifying")
        actual = sha256_file(part)
        if actual != entry.sha256:
            part.unlink()
            raise FetchError(
                f"{url} does not match its sha256 (expected {entry.sha256}, got {actual}); the download was "
                "removed and the next attempt starts it over"
            )
        progress.set_state("fetching")
    with open(part, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(part, target)
    _fsync_dir(target.parent)


def _copy_body(response, part: Path, mode: str, url: str, have: int, progress: Progress, cancel) -> int:
    """Append (or write) the body to the part; returns the bytes received. The part is kept on failure."""
    received = 0
    with open(part, mode) as out:
        while True:
            if cancel is not None and cancel.is_set():
                raise FetchError("stopped")
            try:
                chunk = response.raw.read1(CHUNK, decode_content=False)
            except Exception as error:  # urllib3's ProtocolError, IncompleteRead, ReadTimeoutError
                out.flush()
                reason = "timed out" if "timed out" in str(error).lower() else "the connection ended early"
                raise FetchError(
                    f"{url} stopped after {have + received:,} bytes ({reason}); the part is kept and the next "
                    "attempt resumes from there",
                    transient=True,
                ) from None
            if not chunk:
                return received
            try:
                out.write(chunk)
            except OSError as error:
                raise FetchError(f"writing {part}: {error.strerror}") from None
            received += len(chunk)
            progress.advanced(len(chunk))


def _fetch_file(
    session: requests.Session,
    url: str,
    target: Path,
    cache: Path,
    progress: Progress,
    entry: Entry | None = None,
    cancel: threading.Event | None = None,
) -> None:
    """Download url into target through <target>.part, resuming a part left by an earlier attempt.

    The caller holds the target's lock, and has checked that the target is not already there.
    """
    part = _part_of(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    validator = _read_validator(cache, target)
    have = part.stat().st_size if part.exists() else 0
    if have and not validator:
        # A part with no record of what it is a part of cannot be trusted to
        # continue anything: it might be the start of a different file.
        part.unlink()
        have = 0
    if entry is not None and have > entry.bytes:
        part.unlink()
        have = 0

    for _attempt in range(2):
        headers = {"Accept-Encoding": "identity"}
        if have:
            headers["Range"] = f"bytes={have}-"
            # If-Range: the range applies only to the file the part came from.
            # A file replaced on the mirror comes back whole with a 200.
            headers["If-Range"] = validator.get("etag") or validator.get("last_modified") or ""
            if not headers["If-Range"]:
                del headers["If-Range"]
        try:
            response = session.get(url, headers=headers, stream=True, timeout=TIMEOUT)
        except requests.RequestException as error:
            raise FetchError(f"fetching {url}: {describe(error)}; the next attempt resumes", transient=True) from None
        with response:
            if response.status_code == 416 and have:
                _, total = _content_range_total(response.headers.get("Content-Range"))
                if total == have:
                    # The part is already whole: an earlier attempt died between the
                    # last byte and the rename.
                    _finish(url, part, target, have, entry, progress)
                    return
                # The part is longer than the file now is: it was a part of something else.
                part.unlink()
                progress.restarted(have)
                have, validator = 0, {}
                continue
            if response.status_code == 206 and have:
                start, total = _content_range_total(response.headers.get("Content-Range"))
                if start != have or total is None:
                    raise FetchError(
                        f"{url} answered a request for bytes from {have:,} with the range "
                        f"{response.headers.get('Content-Range')!r}; the part is kept"
                    )
                mode, expected_body = "ab", total - have
            elif response.status_code == 200:
                if have:
                    # The server ignored Range or the file changed: start the file
                    # over. Appending a whole file to a part would make a file that
                    # is neither.
                    progress.restarted(have)
                    have = 0
                length = response.headers.get("Content-Length")
                total = int(length) if length and length.isdigit() else None
                mode, expected_body = "wb", total
            else:
                raise status_error(url, response.status_code)

            # Before the validator is touched: a part must never be paired with the
            # validator of a file it is not the start of.
            if entry is not None and total is not None and total != entry.bytes:
                raise FetchError(
                    f"{url} is {total:,} bytes but the mirror's manifest said {entry.bytes:,}: the file changed on "
                    "the mirror since the manifest was read; fetch again",
                    transient=True,
                )
            if mode == "wb":
                part.unlink(missing_ok=True)
                _write_validator(
                    cache, target, response.headers.get("ETag", ""), response.headers.get("Last-Modified", ""), total
                )
            received = _copy_body(response, part, mode, url, have, progress, cancel)
            if expected_body is not None and received < expected_body:
                raise FetchError(
                    f"{url} ended after {have + received:,} of {have + expected_body:,} bytes; the part is kept and "
                    "the next attempt resumes from there",
                    transient=True,
                )
            if total is None:
                total = part.stat().st_size
            _finish(url, part, target, total, entry, progress)
            return
    raise FetchError(f"{url} kept refusing the range of an earlier attempt; the part was removed, fetch again")


def _head_size(session: requests.Session, url: str) -> int | None:
    try:
        response = session.head(url, timeout=TIMEOUT, allow_redirects=True)
    except requests.RequestException as error:
        raise FetchError(f"asking {url} its size: {describe(error)}", transient=True) from None
    if response.status_code != 200:
        raise status_error(url, response.status_code)
    length = response.headers.get("Content-Length", "")
    return int(length) if length.isdigit() else None


def _check_space(source: str, directory: Path, missing: int) -> None:
    """Refuse up front: a disk that fills at 90% wastes the hour it took to get there."""
    probe = directory
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if missing > free:
        raise FetchError(
            f"fetching {source} needs {missing:,} more bytes ({human_bytes(missing)}) but only {free:,} bytes "
            f"({human_bytes(free)}) are free under {directory}"
        )


def _already_complete(progress: Progress, bytes_total: int, files_total: int, path: Path) -> Path:
    # Reported with its real totals: a second fetch of a finished set must not
    # publish zeros over the numbers of the one that did the work.
    progress.begin(bytes_total=bytes_total, files_total=files_total, bytes_done=bytes_total, files_done=files_total)
    progress.complete()
    return path


def _set_totals(directory: Path) -> tuple[int, int]:
    files = [p for p in directory.iterdir() if not p.name.startswith(".") and p.is_file()]
    return sum(p.stat().st_size for p in files), len(files)


def _session() -> requests.Session:
    session = requests.Session()
    session.headers["User-Agent"] = "llmgw-agent"
    return session


def _fetch_single(source: str, cache: Path, progress: Progress) -> Path:
    target = cache_path(source, cache)
    # A file is renamed into place only when whole, so one that is there is whole.
    if target.exists():
        return _already_complete(progress, target.stat().st_size, 1, target)
    session = _session()
    with _locked(cache, target, progress):
        if target.exists():
            return _already_complete(progress, target.stat().st_size, 1, target)
        total = _head_size(session, source)
        part = _part_of(target)
        have = part.stat().st_size if part.exists() else 0
        if total is not None:
            _check_space(source, target.parent, max(0, total - have))
        progress.begin(bytes_total=total or 0, files_total=1, bytes_done=min(have, total or have))
        progress.file_started(target.name)
        _fetch_file(session, source, target, cache, progress)
        progress.file_done(target.name)
    progress.complete()
    return target


# --- a set ------------------------------------------------------------------------


def _already_there(path: Path, entry: Entry) -> bool:
    try:
        if path.stat().st_size != entry.bytes:
            return False
    except OSError:
        return False
    return not entry.sha256 or sha256_file(path) == entry.sha256


def _fetch_set(source: str, cache: Path, progress: Progress, parallel: int) -> Path:
    directory = cache_path(source, cache)
    # A complete set is marked by a file written last. Checking for the
    # directory alone would treat an interrupted download as finished, which is
    # exactly the failure the marker exists to prevent.
    marker = directory / COMPLETE_MARKER
    if marker.exists():
        return _already_complete(progress, *_set_totals(directory), directory)
    session = _session()
    with _locked(cache, directory, progress):
        if marker.exists():
            return _already_complete(progress, *_set_totals(directory), directory)
        entries = read_manifest(session, source)
        directory.mkdir(parents=True, exist_ok=True)

        todo, bytes_done = [], 0
        for entry in entries:
            target = directory / entry.name
            if _already_there(target, entry):
                bytes_done += entry.bytes
                continue
            todo.append(entry)
        missing = 0
        for entry in todo:
            part = _part_of(directory / entry.name)
            have = part.stat().st_size if part.exists() else 0
            have = have if have <= entry.bytes else 0
            bytes_done += have
            missing += entry.bytes - have
        _check_space(source, directory, missing)
        progress.begin(
            bytes_total=sum(e.bytes for e in entries),
            files_total=len(entries),
            bytes_done=bytes_done,
            files_done=len(entries) - len(todo),
        )

        stop = threading.Event()

        def one(entry: Entry) -> None:
            target = directory / entry.name
            # Its own lock too: a single-file fetch of this very file lands on the same path.
            with _locked(cache, target, progress, cancel=stop):
                if _already_there(target, entry):
                    return
                progress.file_started(entry.name)
                _fetch_file(session, source + entry.name, target, cache, progress, entry, cancel=stop)
                progress.file_done(entry.name)

        # Several files at once: one TCP stream rarely fills a fast link, and
        # shards are independent. The first failure stops the others between chunks.
        with ThreadPoolExecutor(max_workers=max(1, parallel), thread_name_prefix="fetch") as pool:
            futures = [pool.submit(one, entry) for entry in todo]
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            stop_errors = [f.exception() for f in done if f.exception() is not None]
            if stop_errors:
                stop.set()
                for f in futures:
                    f.cancel()
                wait(futures)
                raise stop_errors[0]

        # Whole set or nothing: every file is checked again before the marker,
        # and the marker is written last, atomically.
        for entry in entries:
            target = directory / entry.name
            if not target.exists() or target.stat().st_size != entry.bytes:
                raise FetchError(f"{source}: {entry.name} is missing after the fetch; fetch again")
        tmp = directory / (COMPLETE_MARKER + ".tmp")
        tmp.write_text(source + "\n")
        os.replace(tmp, marker)
        _fsync_dir(directory)
    progress.complete()
    return directory


# --- the entry point --------------------------------------------------------------


def fetch_source(source: str, cache: Path, progress: Progress | None = None, parallel: int | None = None) -> Path:
    """Fetch a source into the cache and return the local file, or the set's directory.

    Raises FetchError with a sentence for the user; nothing half-written is ever
    returned, and a part left behind is resumed by the next call.
    """
    progress = progress if progress is not None else _default_progress(source)
    cache = Path(cache)
    if parallel is None:
        from django.conf import settings

        parallel = getattr(settings, "FETCH_PARALLEL", 4)
    try:
        try:
            cache.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise FetchError(f"the cache {cache} cannot be made: {error.strerror}") from None
        if is_set(source):
            return _fetch_set(source, cache, progress, parallel)
        return _fetch_single(source, cache, progress)
    except Cancelled as cancelled:
        sentence = str(cancelled)
        _report_failure(progress, sentence)
        raise FetchError(sentence) from None
    except FetchError as error:
        _report_failure(progress, str(error))
        raise
    except OSError as error:
        sentence = f"fetching {source}: {error.strerror or error} ({getattr(error, 'filename', '') or cache})"
        _report_failure(progress, sentence)
        raise FetchError(sentence) from None


def _default_progress(source: str) -> Progress:
    """On a node's worker, progress goes to Redis even when the caller did not ask.

    So a fetch started for a replica shows on the version page like one staff
    asked for: whoever waits on the version sees it, whichever task fetches it.
    """
    from . import runtime

    node = runtime.node_name()
    if not node:
        return Progress()
    from .progress import RedisProgress, redis_client

    return RedisProgress(redis_client(), source, node)


def _report_failure(progress: Progress, sentence: str) -> None:
    try:
        progress.failed(sentence)
    except Cancelled:
        pass
    except Exception:
        # Progress is a report, not the fetch: Redis being away must not hide the real sentence.
        pass
