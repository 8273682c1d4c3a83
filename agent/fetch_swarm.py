"""A set fetched through the node's libtorrent session (issue 24), when its manifest offers a torrent.

The torrent is checked against the manifest first (`torrents.checked_torrent`), the files
are written straight into the set's directory by libtorrent, from the other nodes and
from the byte listener as web seed, every piece verified by its SHA-256 Merkle tree; and
then every file's whole sha256 is checked against the manifest's before `fetch_set`
writes `.complete`. A torrent that is not one is not trusted with anything: the set is
fetched over HTTP as before.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import libtorrent as lt
import requests
from django.conf import settings

from contracts.digest import sha256_file
from contracts.sources import cache_parts
from contracts.swarm import SwarmError

from . import peers
from .download import part_of
from .fetch_state import Verified, locked
from .progress import Progress, human_bytes
from .sources import Entry, FetchError, Manifest
from .torrents import checked_torrent, read_torrent

log = logging.getLogger(__name__)


def fetch_by_torrent(
    session: requests.Session,
    source: str,
    cache: Path,
    directory: Path,
    entries: Manifest,
    todo: list[Entry],
    progress: Progress,
    verified: Verified,
) -> bool:
    """Fetch the set's missing files through the swarm; False when its torrent is not one (fetch over HTTP)."""
    # Kept in Redis beside the manifest when the byte listener could not be reached (agent.sources.read_manifest).
    data = entries.torrent.get("data") or read_torrent(session, entries.torrent["url"])
    try:
        lt.torrent_info(lt.bdecode(data))
    except (RuntimeError, TypeError, ValueError):
        log.warning("%s: the mirror's torrent is not a torrent; the set is fetched over HTTP instead", source)
        return False
    version = cache_parts(source)[1][-1]
    info = checked_torrent(data, source, version, entries, entries.torrent["info_hash"])
    single_file = info.num_files() == 1 or len(entries) == 1
    with ExitStack() as files:
        # Each file's own lock too, as the HTTP path takes: a single-file fetch of one of them lands on the same path.
        for entry in todo:
            files.enter_context(locked(cache, directory / entry.name, progress))
        try:
            done = peers.fetch(
                data,
                directory,
                source,
                single_file,
                _on_status(source, progress),
                stall_bytes_s=getattr(settings, "FETCH_STALL_BYTES_S", 1 << 20),
                stall_s=getattr(settings, "FETCH_STALL_S", 20),
            )
        except SwarmError as error:
            raise FetchError(f"fetching {source}: {error}", transient=error.transient) from None
        progress.set_state("verifying")
        _verify_whole_files(source, cache, directory, entries, verified)
        progress.set_state("fetching")
    log.info(
        "%s: fetched, %s from peers and %s from the mirror in %.1f s%s",
        source,
        human_bytes(done["bytes_from_peers"]),
        human_bytes(done["bytes_from_mirror"]),
        done["seconds"],
        f"; banned for bad pieces: {', '.join(done['banned'])}" if done["banned"] else "",
    )
    return True


def _on_status(source: str, progress: Progress) -> Callable[[dict], None]:
    """What the session's status does here: its events and an all-stalled sentence logged once, the progress kept."""
    said_stalled = [""]

    def on_status(status: dict) -> None:
        for event in status.get("events", ()):
            log.warning("%s: %s", source, event)
        stalled = status.get("why", "") if status.get("all_stalled") else ""
        if stalled and stalled != said_stalled[0]:
            log.warning("%s: %s", source, stalled)
        said_stalled[0] = stalled
        progress.swarm(status)

    return on_status


def _verify_whole_files(source: str, cache: Path, directory: Path, entries: Manifest, verified: Verified) -> None:
    """Every file fetched held to the manifest's sha256, synced to disk and recorded as verified."""
    # Already verified, or no sha256 to hold it to: `_mark_complete` says so.
    todo = [entry for entry in entries if entry.name not in verified and entry.sha256]
    # Each file read and hashed in a thread of its own (hashlib lets go of the GIL while it hashes), so the
    # files' hashes share the cores as their transfer did: 2 GiB in four files took 2 s one after another.
    with ThreadPoolExecutor(max(1, min(len(todo), os.cpu_count() or 1)), thread_name_prefix="verify") as pool:
        actuals = list(pool.map(lambda entry: _hashed_and_synced(directory / entry.name), todo))
    for entry, actual in zip(todo, actuals, strict=True):
        path = directory / entry.name
        if actual != entry.sha256:
            # Every piece agreed with the torrent and the file does not with the manifest: a
            # mirror that changed between the two. The file goes, and the next round starts again.
            path.unlink(missing_ok=True)
            peers.resume_path(cache, entries.torrent["info_hash"]).unlink(missing_ok=True)
            raise FetchError(
                f"{source}: {entry.name} does not match its sha256 after the fetch (expected {entry.sha256}, got "
                f"{actual}); it was removed and the next attempt fetches it again",
                transient=True,
            )
        verified[entry.name] = (entry.bytes, path.stat().st_mtime_ns, entry.sha256)
        part_of(path).unlink(missing_ok=True)  # an HTTP attempt's, no longer needed


def _hashed_and_synced(path: Path) -> str:
    """The file's sha256, and the file synced to disk (wasted only on a file that does not match, which goes)."""
    actual = sha256_file(path)
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())
    return actual
