"""A version's torrent as a node takes it: fetched from the byte listener and checked against the manifest.

The manifest is the root of trust (its sha256s are what `.complete` waits on); the torrent
only says how to get the same bytes in verified pieces. So a torrent that names other
files, other sizes, another root or another info-hash than the manifest is refused with
a sentence, before any piece is asked for.
"""

from __future__ import annotations

import libtorrent as lt
import requests

from .sources import TIMEOUT, Entry, FetchError, describe, status_error

TORRENT_LIMIT = 64 << 20  # a v2 torrent of 1 TB in 4 MiB pieces carries about 8 MB of piece layers


def read_torrent(session: requests.Session, url: str) -> bytes:
    try:
        response = session.get(url, timeout=TIMEOUT, stream=True)
    except requests.RequestException as error:
        raise FetchError(f"asking {url} for the torrent: {describe(error)}", transient=True) from None
    with response:
        if response.status_code != 200:
            raise status_error(url, response.status_code, response)
        data = response.raw.read(TORRENT_LIMIT + 1, decode_content=True)
    if len(data) > TORRENT_LIMIT:
        raise FetchError(f"{url} answered more than {TORRENT_LIMIT >> 20} MiB where a torrent was expected")
    return data


def checked_torrent(data: bytes, source: str, version: str, entries: list[Entry], info_hash: str) -> lt.torrent_info:
    """The torrent, when it describes exactly the manifest's files; otherwise FetchError saying how it differs."""
    try:
        info = lt.torrent_info(lt.bdecode(data))
    except (RuntimeError, TypeError, ValueError):
        raise FetchError(
            f"{source}: the mirror's torrent is not a torrent; the set is fetched over HTTP instead"
        ) from None
    hashes = info.info_hashes()
    if not hashes.has_v2() or hashes.has_v1():
        raise FetchError(f"{source}: the mirror's torrent is not a BitTorrent v2 torrent; refused")
    if str(hashes.v2) != info_hash:
        raise FetchError(
            f"{source}: the mirror's torrent has the info-hash {hashes.v2}, not the manifest's {info_hash}; refused"
        )
    if not info.priv():
        raise FetchError(f"{source}: the mirror's torrent is not private (it would be announced to the DHT); refused")
    layout = info.layout()
    paths = {
        layout.file_path(i): layout.file_size(i)
        for i in range(layout.num_files())
        if not layout.file_flags(i) & lt.file_storage.flag_pad_file
    }
    # A version of one file is a single-file torrent named for that file (libtorrent makes
    # it so); a version of several is a folder named for the version.
    single = len(paths) == 1 and "/" not in next(iter(paths))
    if not single and layout.name() != version:
        raise FetchError(
            f"{source}: the mirror's torrent is for the folder {layout.name()!r}, not {version!r}; refused"
        )
    files = {path.removeprefix(version + "/"): size for path, size in paths.items()}
    wanted = {e.name: e.bytes for e in entries}
    if files != wanted:
        extra = sorted(set(files) - set(wanted))
        missing = sorted(set(wanted) - set(files))
        sized = sorted(n for n in set(files) & set(wanted) if files[n] != wanted[n])
        said = []
        if missing:
            said.append(f"it lacks {', '.join(missing)}")
        if extra:
            said.append(f"it names {', '.join(extra)}, which the manifest does not")
        if sized:
            said.append(", ".join(f"{n} is {files[n]:,} bytes in it and {wanted[n]:,} in the manifest" for n in sized))
        raise FetchError(f"{source}: the mirror's torrent disagrees with its manifest ({'; '.join(said)}); refused")
    return info
