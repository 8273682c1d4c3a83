"""Fetching weights from the mirror: one file resumable, a set whole or not at all.

Used by the node's worker (`agent.fetch`), the engine tasks and `manage.py fetch`,
so resume, verification, the .part rename and progress live in one place:
`fetch_source` here, one address into one file in `agent.download`, a version into
a directory in `agent.fetch_set`, locks and validators in `agent.fetch_state`, and
what an address names and what a manifest may say in `agent.sources`.
"""

from __future__ import annotations

import time
from pathlib import Path
from urllib.parse import quote, unquote

from django.conf import settings

from contracts.digest import sha256_file
from contracts.sources import is_set

from . import runtime
from .download import check_space, fetch_file, head_size, new_session, part_of
from .fetch_set import CHECK_TIMEOUT, fetch_set, manifest_when_ready
from .fetch_state import locked, read_verified, still_verified, write_verified
from .progress import Cancelled, Progress, RedisProgress, redis_client
from .sources import Entry, FetchError, cache_path, read_manifest, refuse_other_hosts

__all__ = ["FetchError", "cache_path", "fetch_source", "is_set"]


def fetch_source(
    source: str,
    cache: Path,
    progress: Progress | None = None,
    parallel: int | None = None,
    *,
    any_host: bool = False,
) -> Path:
    """Fetch a source into the cache and return the local file, or the set's directory.

    Only from this node's byte listener (LLMGW_BYTES_URL), unless `any_host` (a
    one-off copy staff ask for by hand with `manage.py fetch --allow-any-host`).
    Raises FetchError with a sentence for the user; nothing half-written is ever
    returned, and a part left behind is resumed by the next call.
    """
    progress = progress if progress is not None else _default_progress(source)
    cache = Path(cache)
    if parallel is None:
        parallel = getattr(settings, "FETCH_PARALLEL", 4)
    try:
        # Both before any request: what the address would write, and where it would ask.
        cache_path(source, cache)
        if not any_host:
            refuse_other_hosts(source, settings.BYTES_URL)
        try:
            cache.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise FetchError(f"the cache {cache} cannot be made: {error.strerror}") from None
        if is_set(source):
            return fetch_set(source, cache, progress, parallel)
        return _fetch_single(source, cache, progress, any_host)
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


def _fetch_single(source: str, cache: Path, progress: Progress, any_host: bool) -> Path:
    """One file. From this node's byte listener it is a file of a mirror version, and that
    version's manifest says its size and sha256 and whether it is whole yet (issue 21);
    elsewhere (`--allow-any-host`) a HEAD says its size, as any server can."""
    target = cache_path(source, cache)
    session = new_session(source)
    version, _, quoted_name = source.rpartition("/")
    version += "/"
    name = unquote(quoted_name)
    # A file is renamed into place only when whole, so one that is there is whole, and
    # still the mirror's when what was verified of it agrees with the manifest.
    if target.exists() and (any_host or _cached_file_holds(session, version, name, cache, target)):
        progress.already_complete(bytes_total=target.stat().st_size, files_total=1)
        return target
    with locked(cache, target, progress):
        entry = None
        if not any_host:
            entry = _entry_when_ready(session, version, name, progress)
            if target.exists() and _file_is(cache, target, entry):
                progress.already_complete(bytes_total=target.stat().st_size, files_total=1)
                return target
        elif target.exists():
            progress.already_complete(bytes_total=target.stat().st_size, files_total=1)
            return target
        total = entry.bytes if entry is not None else head_size(session, source)
        part = part_of(target)
        have = part.stat().st_size if part.exists() else 0
        if total is not None:
            check_space(source, target.parent, max(0, total - have))
        progress.begin(bytes_total=total or 0, files_total=1, bytes_done=min(have, total or have))
        progress.file_started(target.name)
        fetch_file(session, source, target, cache, progress, entry=entry, size=total, need_sha256=entry is not None)
        if entry is not None:
            write_verified(cache, target, {name: (entry.bytes, target.stat().st_mtime_ns, entry.sha256)})
        progress.file_done(target.name)
    progress.complete()
    return target


def _entry_when_ready(session, version: str, name: str, progress: Progress) -> Entry:
    deadline = time.monotonic() + settings.FETCH_WAIT_S
    for entry in manifest_when_ready(session, version, progress, deadline):
        if entry.name == name:
            return entry
    raise FetchError(f"{version}{quote(name, safe='')} is not on the mirror: its version's manifest has no {name!r}")


def _cached_file_holds(session, version: str, name: str, cache: Path, target: Path) -> bool:
    """As for a set (`fetch_set._cached_set_holds`): the manifest asked, nothing hashed, the cache used when it cannot say."""
    try:
        entries = read_manifest(session, version, timeout=CHECK_TIMEOUT)
    except FetchError:
        return True
    entry = next((e for e in entries if e.name == name), None)
    if entry is None:
        return True  # gone from the mirror: what was verified stays usable
    return still_verified(target, read_verified(cache, target).get(name), entry.bytes, entry.sha256)


def _file_is(cache: Path, target: Path, entry: Entry) -> bool:
    """Whether the cached file is the manifest's: by what was verified of it, else hashed once and remembered."""
    if still_verified(target, read_verified(cache, target).get(entry.name), entry.bytes, entry.sha256):
        return True
    if not entry.sha256 or target.stat().st_size != entry.bytes or sha256_file(target) != entry.sha256:
        return False
    write_verified(cache, target, {entry.name: (entry.bytes, target.stat().st_mtime_ns, entry.sha256)})
    return True


def _default_progress(source: str) -> Progress:
    """On a node's worker, progress goes to Redis even when the caller did not ask.

    So a fetch started for a replica shows on the version page like one staff
    asked for: whoever waits on the version sees it, whichever task fetches it.
    """
    node = runtime.node_name()
    if not node:
        return Progress()
    return RedisProgress(redis_client(), source, node)


def _report_failure(progress: Progress, sentence: str) -> None:
    try:
        progress.failed(sentence)
    except Cancelled:
        pass
    except Exception:
        # Progress is a report, not the fetch: Redis being away must not hide the real sentence.
        pass
