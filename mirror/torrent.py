"""Each version as a BitTorrent v2 torrent, computed from the directory like its hashes (issue 24).

v2 (SHA-256 Merkle trees over 16 KiB blocks, one tree per file) so a node verifies every
piece before it counts, and private (no DHT, no PEX, no local discovery): peers are found
through the control plane only. One piece size for every version, PIECE_BYTES: why that
size is in docs/mirror.md ("The torrent").

The torrent is kept in the index (`MirrorVersion.torrent`), fingerprinted by the files'
names, sizes and sha256s (`torrent_of`): a file copied in by hand changes the
fingerprint, and the next manifest or hash computes the torrent again. The manifest stays
the source of truth; a node refuses a torrent that disagrees with it.
"""

from __future__ import annotations

import hashlib
import json
import os

import libtorrent as lt

from . import disk
from .models import MirrorVersion

PIECE_BYTES = 4 << 20


def fingerprint(files: list[tuple[str, int, str]]) -> str:
    """What a torrent was made for: (name, bytes, sha256) of every file, in one digest."""
    return hashlib.sha256(json.dumps(sorted(files)).encode()).hexdigest()


def make(model: str, version: str, files: list[tuple[str, int]]) -> tuple[bytes, str] | None:
    """(the bencoded torrent, its v2 info-hash) of a version's files as they are now; None if one changed meanwhile.

    The torrent's root folder is the version's name and its files are the version's, so a
    node's libtorrent, saving into the model's directory of its cache, writes them straight
    into the set's own directory.
    """
    base = disk.resolve(model)
    if base is None:
        return None
    base = os.path.realpath(base)
    before = _stats(base, version, files)
    if before is None:
        return None
    entries = [lt.create_file_entry(f"{version}/{name}", size) for name, size in sorted(files)]
    creator = lt.create_torrent(entries, PIECE_BYTES, lt.create_torrent.v2_only)
    creator.set_priv(True)
    creator.set_creator("llmgw")
    try:
        lt.set_piece_hashes(creator, base)
    except RuntimeError:
        return None  # a file went away or shrank under the read
    data = lt.bencode(creator.generate())
    if _stats(base, version, files) != before:
        return None
    return data, str(lt.torrent_info(data).info_hashes().v2)


def _stats(base: str, version: str, files: list[tuple[str, int]]) -> list[tuple[int, int]] | None:
    out = []
    for name, size in sorted(files):
        try:
            st = os.stat(os.path.join(base, version, name))
        except OSError:
            return None
        if st.st_size != size:
            return None
        out.append((st.st_size, st.st_mtime_ns))
    return out


def current(model: str, version: str, files: list[tuple[str, int, str]]) -> MirrorVersion | None:
    """The version's row when its stored torrent is for exactly these files, else None."""
    row = MirrorVersion.objects.filter(model=model, version=version).only("torrent_info_hash", "torrent_of").first()
    if row is None or not row.torrent_info_hash or row.torrent_of != fingerprint(files):
        return None
    return row


def ensure(model: str, version: str, files: list[tuple[str, int, str]]) -> str:
    """The v2 info-hash of the version's torrent, computed and stored now if it is missing or stale; "" if it cannot be."""
    row = current(model, version, files)
    if row is not None:
        return row.torrent_info_hash
    made = make(model, version, [(name, size) for name, size, _ in files])
    if made is None:
        return ""
    data, info_hash = made
    MirrorVersion.objects.filter(model=model, version=version).update(
        torrent=data, torrent_info_hash=info_hash, torrent_of=fingerprint(files)
    )
    return info_hash


def stored(model: str, version: str, files: list[tuple[str, int, str]]) -> bytes | None:
    """The stored torrent when it is for exactly these files."""
    row = current(model, version, files)
    if row is None:
        return None
    return bytes(MirrorVersion.objects.values_list("torrent", flat=True).get(pk=row.pk))
