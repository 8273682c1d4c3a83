"""libtorrent's resume record of a fetch: read back, trimmed to what the disk still holds, and written.

A kill loses at most a second of verified work: the fetch asks for the record every
second while pieces arrive, and the session's alert thread writes it (`write`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import libtorrent as lt

from contracts.swarm.torrent import rooted

# One logger for the whole package, as when it was one module: operators filter on its name.
log = logging.getLogger("contracts.swarm")


def read(resume: Path | None, info: lt.torrent_info, key: str, dest: Path) -> lt.add_torrent_params | None:
    """The record at `resume` of this torrent, with the pieces the disk lost taken out; None: the files are hashed."""
    if resume is None or not resume.exists():
        return None
    try:
        params = lt.read_resume_data(resume.read_bytes())
    except (RuntimeError, ValueError):
        return None  # unreadable: the files are hashed instead
    if info_hash_of_params(params) not in ("", key):
        return None  # the record of another torrent
    _forget_what_the_disk_lost(params, info, dest)
    return params


def write(path: Path, params: lt.add_torrent_params) -> None:
    data = lt.write_resume_data_buf(params)
    tmp = path.with_name(path.name + ".tmp")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_bytes(data)
    os.replace(tmp, path)


def save(held) -> None:
    """Ask for a torrent's record and wait (up to 10 s) until the alert thread has written it."""
    if held.resume_path is None or not held.handle.is_valid():
        return
    held.resume_saved.clear()
    try:
        held.handle.flush_cache()  # and, once flushed, the resume data (the alert thread asks for it)
    except RuntimeError:
        return
    held.resume_saved.wait(10)


def info_hash_of_params(params: lt.add_torrent_params) -> str:
    try:
        hashes = params.info_hashes
        return str(hashes.v2) if hashes.has_v2() else ""
    except (AttributeError, RuntimeError):
        return ""


def _forget_what_the_disk_lost(params: lt.add_torrent_params, info: lt.torrent_info, dest: Path) -> None:
    """Take out of a resume record the pieces its files no longer hold: a file cut short or removed since.

    libtorrent believes its record without looking: a file cut short after it was whole
    would be seeded as it is, the fetch would fetch nothing, and the manifest's sha256
    would then fail. A piece counts only where every one of its files on disk still
    reaches its end; the others are fetched again, the rest of the record kept.
    """
    layout = info.layout()
    paths = {i: dest / name for i, name in rooted(info).items()}
    sizes: dict[int, int] = {}

    def size_on_disk(i: int) -> int:
        if i not in sizes:
            try:
                sizes[i] = (paths.get(i) or dest / layout.file_path(i)).stat().st_size
            except OSError:
                sizes[i] = 0
        return sizes[i]

    def held(piece: int) -> bool:
        return all(
            layout.file_flags(s.file_index) & lt.file_storage.flag_pad_file
            or size_on_disk(s.file_index) >= s.offset + s.size
            for s in info.map_block(piece, 0, info.piece_size(piece))
        )

    have = list(params.have_pieces)
    lost = [i for i in range(min(len(have), info.num_pieces())) if have[i] and not held(i)]
    for i in lost:
        have[i] = False
    unfinished = dict(params.unfinished_pieces)
    for piece in [p for p in unfinished if not held(int(p))]:
        del unfinished[piece]
    if lost:
        log.warning("%d verified piece(s) of %s are no longer on disk; they are fetched again", len(lost), dest)
    params.have_pieces = have
    params.unfinished_pieces = unfinished
