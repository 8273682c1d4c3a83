"""A pull's copy made whole, checked and put in the mirror (mirror/pull.py).

Renamed into place only when every file's sha256 agrees with the other mirror's manifest
(libtorrent verified every piece already), then indexed at once with the hashes just
checked and the torrent just used, so the scan does not hash the version again.
"""

from __future__ import annotations

import os
from pathlib import Path

import libtorrent as lt
from django.utils import timezone

from contracts.digest import sha256_file

from . import disk, headers, scan, torrent
from .models import MirrorFile, MirrorVersion
from .pull_remote import Address, Manifest, PullError


def put_in_mirror(address: Address, manifest: Manifest, staging: Path, target: Path, resume: Path, data: bytes) -> None:
    """The copy in `staging` verified, renamed to `target` and indexed; PullError, with nothing put in the mirror, if not."""
    verified = _verify(staging, manifest)
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists() or target.is_symlink():
        raise PullError(f"{address.model}/{address.version} appeared in this mirror during the pull; left as it is")
    os.rename(staging, target)
    resume.unlink(missing_ok=True)
    _index(address, manifest, verified, data)


def _verify(staging: Path, manifest: Manifest) -> dict[str, tuple[int, int, str]]:
    """Every file whole and its sha256 the manifest's: name -> (bytes, mtime_ns, sha256) as they are now."""
    disk.mark_settled(staging)  # whole once renamed: not "still being written" for LLMGW_MIRROR_SETTLE_S
    on_disk = {p.name for p in staging.iterdir()}
    if on_disk != {name for name, _, _ in manifest.files}:
        raise PullError(f"the copy holds {sorted(on_disk)}, not the manifest's files; nothing was put in the mirror")
    verified = {}
    for name, size, digest in manifest.files:
        path = staging / name
        before = os.stat(path)
        if before.st_size != size:
            raise PullError(f"{name} is {before.st_size:,} bytes after the copy, not {size:,}")
        got = sha256_file(path)
        if got != digest:
            # Dropped with the resume record that counted its pieces as verified, so the next pull fetches it again.
            path.unlink()
            staging.with_name(f"{staging.name}.resume").unlink(missing_ok=True)
            raise PullError(
                f"{name}'s sha256 is {got}, not the other mirror's {digest}: the file is dropped and fetched again "
                "at the next pull; nothing was put in the mirror"
            )
        verified[name] = (before.st_size, before.st_mtime_ns, digest)
    return verified


def _index(address: Address, manifest: Manifest, verified: dict[str, tuple[int, int, str]], data: bytes) -> None:
    """The version in this mirror's index at once, with the hashes just checked and the torrent just used.

    The sha256s are stored against the size and mtime they were computed for, so a file
    touched since is hashed again as usual; the torrent is the other mirror's, which has
    the same info-hash this mirror would compute (same files, same piece size).
    """
    report = scan.index_version(address.model, address.version)
    for name, (size, mtime_ns, digest) in verified.items():
        MirrorFile.objects.filter(
            version__model=address.model,
            version__version=address.version,
            name=name,
            bytes=size,
            mtime_ns=mtime_ns,
            sha256="",
        ).update(sha256=digest, hashed_at=timezone.now())
    triples = [(name, size, digest) for name, (size, _, digest) in verified.items()]
    if torrent.PIECE_BYTES == lt.torrent_info(lt.bdecode(data)).piece_length():
        MirrorVersion.objects.filter(model=address.model, version=address.version).update(
            torrent=data, torrent_info_hash=manifest.info_hash, torrent_of=torrent.fingerprint(triples)
        )
    headers.read_changed(report)
