"""What a source address names, checked the same way where it is asked for and where it is fetched.

A source ending in `/` names a version (a set of files); without it, one file. The
control plane checks an address with `cache_parts` before it sends a node anything,
so staff get the node's own sentence at once rather than a failed fetch later.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from urllib.parse import unquote, urlsplit

from .names import plain_name_problem

# The byte listener serves a version's files under other addresses too, `/.seed/<n>/<model>/<version>/<file>`,
# exactly as under `/<model>/<version>/<file>`: libtorrent opens one connection per web seed URL, so a fetch
# given n of them has n connections to the mirror, where a link limits each connection (issue 24).
SEED_ALIAS = ".seed"


class SourceError(ValueError):
    """A source that no node would fetch; str() is the sentence."""


def is_remote(source: str) -> bool:
    parts = urlsplit(source)
    return parts.scheme in ("http", "https") and bool(parts.netloc)


def is_set(source: str) -> bool:
    """Whether a source names a set of files (a mirror version) rather than one file."""
    return is_remote(source) and source.endswith("/")


def cache_parts(source: str) -> tuple[str, list[str]]:
    """(host directory, path segments) of where a source lives in a node's cache.

    Every path segment is decoded and checked on its own: no address, however
    encoded, names anything but plain names under its host's directory.
    """
    if not is_remote(source):
        raise SourceError(f"{source!r} is not an http:// or https:// address")
    parts = urlsplit(source)
    if parts.query or parts.fragment:
        raise SourceError(f"{source} carries a query or fragment; a mirror address is a plain path")
    host = (parts.hostname or "").lower()
    if not re.fullmatch(r"[a-z0-9][a-z0-9.\-]*|\[?[0-9a-f:.]+\]?", host):
        raise SourceError(f"{source} names a host that cannot be a directory of the cache")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise SourceError(f"{source} names a port that is not a number") from None
    host_dir = f"{host.strip('[]').replace(':', '-')}_{port}"
    path = parts.path.rstrip("/") if source.endswith("/") else parts.path
    segments = [unquote(s) for s in path.split("/")[1:]]
    if not segments:
        raise SourceError(f"{source} names no file or version, only a host")
    for segment in segments:
        problem = plain_name_problem(segment)
        if problem is not None:
            raise SourceError(
                f"{source} is refused rather than cached: a part of its path is not a plain name: {problem}"
            )
    return host_dir, segments


def seed_alias(root: str, address: str, n: int) -> str:
    """`address` (under the byte listener's `root`) as its alias number n; an address not under root as it is."""
    if not address.startswith(root):
        return address
    return f"{root}{SEED_ALIAS}/{int(n)}/{address[len(root) :]}"


def version_digest(manifest: bytes, info_hash: str, torrent: bytes) -> str:
    """One digest of a version's manifest (its JSON as written), its torrent's info-hash and the torrent itself."""
    torrent_sha = hashlib.sha256(torrent).hexdigest()
    return hashlib.sha256(b"|".join([manifest, info_hash.encode(), torrent_sha.encode()])).hexdigest()


def version_mac(key: str, node: str, model: str, version: str, digest: str) -> str:
    """The byte listener's word to node `node` that `digest` is the version's (issue 38).

    Keyed by the node's token hash, which the control plane and that node hold and no other node
    does: a manifest and torrent in Redis are believed by a node only with its own MAC over them,
    so whoever else can write to Redis cannot hand it other weights (docs/mirror.md).
    """
    said = f"llmgw-version|{node}|{model}/{version}|{digest}".encode()
    return hmac.new(key.encode(), said, hashlib.sha256).hexdigest()
