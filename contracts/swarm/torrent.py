"""A torrent as the swarm reads it: its info, the hash it is known by, and where its files go on this disk."""

from __future__ import annotations

import libtorrent as lt


class SwarmError(Exception):
    """A fetch that did not finish; str() is the sentence. `transient` when trying again may well succeed."""

    def __init__(self, sentence: str, transient: bool = False):
        super().__init__(sentence)
        self.transient = transient


def torrent_info(torrent: bytes) -> lt.torrent_info:
    try:
        return lt.torrent_info(lt.bdecode(torrent))
    except (RuntimeError, TypeError, ValueError):
        raise SwarmError("the torrent given is not a torrent") from None


def info_hash_of(torrent: bytes | lt.torrent_info) -> str:
    """The v2 info-hash (hex) of a torrent: what it is known by here."""
    info = torrent if isinstance(torrent, lt.torrent_info) else torrent_info(torrent)
    hashes = info.info_hashes()
    return str(hashes.v2 if hashes.has_v2() else hashes.v1)


def rooted(info: lt.torrent_info) -> dict[int, str]:
    """Where each file goes: its path in the torrent with the root folder dropped (for add_torrent_params.renamed_files).

    Only where the files go on this disk: the info-hash, and the paths asked of a web seed
    (libtorrent uses the torrent's own names for those), stay the torrent's.
    """
    layout = info.layout()
    renamed = {}
    for i in range(layout.num_files()):
        if layout.file_flags(i) & lt.file_storage.flag_pad_file:
            continue
        root, sep, rest = layout.file_path(i).partition("/")
        if sep:
            renamed[i] = rest
    return renamed


def payload_bytes(info: lt.torrent_info) -> int:
    layout = info.layout()
    return sum(
        layout.file_size(i)
        for i in range(layout.num_files())
        if not layout.file_flags(i) & lt.file_storage.flag_pad_file
    )


def running(flags):
    """Started now and kept so: not paused, and not auto-managed (libtorrent's queue would pause it again)."""
    return flags & ~lt.torrent_flags.paused & ~lt.torrent_flags.auto_managed
