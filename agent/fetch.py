"""Fetching weights from the mirror: one file resumable, a set whole or not at all.

Used by the node's worker (`agent.fetch`), the engine tasks and `manage.py fetch`,
so resume, verification, the .part rename and progress live in one place:
`fetch_source` here, one address into one file in `agent.download`, a version into
a directory in `agent.fetch_set`, locks and validators in `agent.fetch_state`, and
what an address names and what a manifest may say in `agent.sources`.
"""

from __future__ import annotations

from pathlib import Path

from django.conf import settings

from contracts.sources import is_set

from . import runtime
from .download import check_space, fetch_file, head_size, new_session, part_of
from .fetch_set import fetch_set
from .fetch_state import locked
from .progress import Cancelled, Progress, RedisProgress, redis_client
from .sources import FetchError, cache_path, refuse_other_hosts

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


def _fetch_single(source: str, cache: Path, progress: Progress) -> Path:
    target = cache_path(source, cache)
    # A file is renamed into place only when whole, so one that is there is whole.
    if target.exists():
        progress.already_complete(bytes_total=target.stat().st_size, files_total=1)
        return target
    session = new_session(source)
    with locked(cache, target, progress):
        if target.exists():
            progress.already_complete(bytes_total=target.stat().st_size, files_total=1)
            return target
        total = head_size(session, source)
        part = part_of(target)
        have = part.stat().st_size if part.exists() else 0
        if total is not None:
            check_space(source, target.parent, max(0, total - have))
        progress.begin(bytes_total=total or 0, files_total=1, bytes_done=min(have, total or have))
        progress.file_started(target.name)
        fetch_file(session, source, target, cache, progress, size=total)
        progress.file_done(target.name)
    progress.complete()
    return target


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
