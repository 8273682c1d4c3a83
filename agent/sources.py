"""What a source address names, and what the mirror says a version holds.

A source ending in `/` names a version (a set of files); without it, one file.
The trailing slash is the whole signal: a flag beside the source would be a
second place for the two to disagree. Nothing here downloads weights; it decides
where they would go and refuses whatever is not safe to join onto a path.
"""

from __future__ import annotations

import hmac
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import redis
import requests

from contracts.names import plain_name_problem
from contracts.sources import SourceError, cache_parts

MANIFEST_LIMIT = 1 << 20
TIMEOUT = (10, 60)  # connect, and between two reads of a body
SHA256 = re.compile(r"^[0-9a-f]{64}$")


class FetchError(Exception):
    """A fetch that did not finish; str() is the sentence for the user.

    `transient` when trying again by itself may well succeed (the network, a
    mirror restarting, a file replaced under the fetch); otherwise trying again
    would only say the same thing, and the task stops with the sentence.
    """

    def __init__(self, sentence: str, transient: bool = False):
        super().__init__(sentence)
        self.transient = transient


class NotReady(FetchError):
    """The mirror says the version is not whole yet (a file still being written, hashes not yet
    computed): `retry_after` seconds from now it may be. A fetch waits on it rather than failing."""

    def __init__(self, sentence: str, retry_after: int):
        super().__init__(sentence, transient=True)
        self.retry_after = retry_after


class MirrorChanged(FetchError):
    """A file changed on the mirror while it was fetched: the set is read again from its manifest."""

    def __init__(self, sentence: str):
        super().__init__(sentence, transient=True)


def retry_after_of(response: requests.Response, default: int = 10) -> int:
    """The answer's Retry-After in seconds (delta form), kept between 1 s and 5 min."""
    value = (response.headers.get("Retry-After") or "").strip()
    seconds = int(value) if value.isdigit() else default
    return min(300, max(1, seconds))


def status_error(url: str, status: int, response: requests.Response | None = None) -> FetchError:
    if status == 404:
        return FetchError(f"{url} is not on the mirror (404)")
    if status == 401:
        # Not transient: a revoked node stays revoked, and the part is kept for a node that is enrolled again.
        return FetchError(f"the byte listener refused {url} (401): {refusal_of(response)}")
    return FetchError(f"{url} answered {status}", transient=status >= 500 or status == 429)


def refusal_of(response: requests.Response | None) -> str:
    """The byte listener's sentence for a refusal, and whether this fetch presented a pass at all."""
    try:
        said = response.json().get("error") if response is not None else None
    except (ValueError, AttributeError):
        said = None
    said = said if isinstance(said, str) and said else "this node's pass was not accepted"
    if response is not None and response.request is not None and "Authorization" not in response.request.headers:
        said += " (this fetch presented no pass: LLMGW_NODE_NAME or LLMGW_NODE_TOKEN is not set)"
    return said


@dataclass(frozen=True)
class Entry:
    name: str
    bytes: int
    sha256: str = ""


class Manifest(list):
    """A version's entries (a list of Entry, as before), and what the manifest says of its torrent.

    `torrent` is {"info_hash", "url"} when the mirror offers the version as a BitTorrent v2
    torrent (issue 24), else None: an older mirror or another server, fetched over HTTP.
    """

    torrent: dict | None = None


def _torrent_of(manifest: dict, source: str) -> dict | None:
    said = manifest.get("torrent")
    if not isinstance(said, dict):
        return None
    info_hash = said.get("info_hash")
    if not (isinstance(info_hash, str) and SHA256.match(info_hash)):
        return None
    # Asked at the version's own address on the node's own byte listener, whatever host the
    # answer names (a proxy between them, another name for the same listener).
    return {"info_hash": info_hash, "url": source + "?torrent"}


def cache_path(source: str, cache: Path) -> Path:
    """Where a source lives in the cache: <cache>/<host>_<port>/<path...>.

    Every path segment is decoded and checked on its own, and the result must
    lie under the cache: no address, however encoded, writes anywhere else.
    """
    try:
        host_dir, segments = cache_parts(source)
    except SourceError as error:
        raise FetchError(str(error)) from None
    cache = Path(cache)
    target = cache.joinpath(host_dir, *segments)
    real_cache = Path(os.path.realpath(cache))
    real = Path(os.path.realpath(target))
    if real_cache not in real.parents:
        raise FetchError(f"{source} would be written outside the cache {cache}; it is refused")
    return target


def origin(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of an address, the port filled in from the scheme."""
    parts = urlsplit(url)
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        port = -1
    return parts.scheme.lower(), (parts.hostname or "").lower(), port


def refuse_other_hosts(source: str, byte_listener: str) -> None:
    """Refuse, before any request, an address that is not on this node's byte listener.

    The source comes in a message, and whoever can write to the broker could name any
    host: a cloud's metadata address, a service on the node itself. A node fetches only
    from the byte listener it is configured with (LLMGW_BYTES_URL).
    """
    if origin(source) != origin(byte_listener):
        raise FetchError(
            f"{source} is not on this node's byte listener {byte_listener} (LLMGW_BYTES_URL); "
            "a node fetches only from there"
        )


def read_manifest(session: requests.Session, source: str, timeout=TIMEOUT, kept_copy: bool = True) -> Manifest:
    """Ask the mirror what a version consists of, and refuse anything unsafe in the answer.

    Raises NotReady when the mirror answers that the version is not whole yet (503,
    `"ready": false`, `Retry-After`): a file still being copied in, hashes not computed.

    When the byte listener cannot be reached (its host gone, an error of its own), the copy
    it wrote into Redis when it last served the version is taken instead (issue 38), with its
    torrent: the set is then fetched from the peers that hold it. Only what the byte listener
    wrote is there (nodes may read those keys, not write them), and it is checked as the
    answer would be. `kept_copy=False` for a listener that has just answered: what it said
    last (say, "not ready") is newer than any copy, so the copy is not taken for it.
    """
    try:
        return _read_manifest(session, source, timeout)
    except NotReady:
        raise
    except FetchError as error:
        if not (error.transient and kept_copy):
            raise
        try:
            kept = manifest_from_redis(source)
        except FetchError as refused:
            raise FetchError(f"{error}; {refused}", transient=True) from None
        if kept is None:
            raise
        return kept


def manifest_from_redis(source: str) -> Manifest | None:
    """The version's manifest and torrent as the byte listener last wrote them into Redis; None if there are none."""
    from django.conf import settings

    from contracts import keys, signing
    from contracts.redis_client import redis_client
    from contracts.sources import version_digest, version_mac

    from . import runtime

    root = getattr(settings, "BYTES_URL", "")
    if not (root and source.startswith(root) and source.endswith("/")):
        return None
    parts = source[len(root) :].rstrip("/").split("/")
    if len(parts) != 2:
        return None
    model, version = (unquote(p) for p in parts)
    url = getattr(settings, "REDIS_URL", "")
    if not url:
        return None  # `manage.py fetch` on a host that is no node
    try:
        kept = redis_client(url).hgetall(keys.swarm_version_key(model, version))
    except (redis.RedisError, ValueError):
        return None
    said, torrent, info_hash = kept.get(b"manifest"), kept.get(b"torrent"), kept.get(b"info_hash")
    if not (said and torrent and info_hash):
        return None
    # Believed only with this node's own MAC over it, which only the byte listener can make (contracts.sources).
    node, token = runtime.node_name(), runtime.token()
    digest = version_digest(said, info_hash.decode(), torrent)
    mac = (kept.get(f"mac:{node}".encode()) or b"").decode()
    if not (node and token and mac):
        return None  # not vouched for to this node (it never announced since the version was written)
    if not hmac.compare_digest(mac, version_mac(signing.token_hash(token), node, model, version, digest)):
        raise FetchError(
            "the copy of its manifest in Redis does not carry the byte listener's word for this node "
            "(changed by someone else since it was written); refused"
        )
    entries = _parsed(said, source)
    if entries.torrent is None or entries.torrent["info_hash"] != info_hash.decode():
        return None
    entries.torrent["data"] = bytes(torrent)
    return entries


def _read_manifest(session: requests.Session, source: str, timeout) -> Manifest:
    try:
        response = session.get(source, timeout=timeout, stream=True, headers={"Accept": "application/json"})
    except requests.RequestException as error:
        raise FetchError(f"asking {source} what it holds: {describe(error)}", transient=True) from None
    with response:
        if response.status_code == 503:
            not_ready = _not_ready(source, response)
            if not_ready is not None:
                raise not_ready
        if response.status_code != 200:
            raise status_error(source, response.status_code, response)
        try:
            body = b""
            for chunk in response.iter_content(64 * 1024):
                body += chunk
                if len(body) > MANIFEST_LIMIT:
                    break
        except Exception as error:
            raise FetchError(f"asking {source} what it holds: {describe(error)}", transient=True) from None
    if len(body) > MANIFEST_LIMIT:
        raise FetchError(f"{source} answered more than 1 MiB where a manifest was expected; it is not a mirror version")
    return _parsed(body, source)


def _parsed(body: bytes, source: str) -> Manifest:
    """A manifest's body, every name, size and sha256 checked; FetchError with the sentence otherwise."""
    not_a_manifest = FetchError(
        f"{source} did not answer with a manifest; a source ending in / has to be a mirror version, not a "
        "directory listing"
    )
    try:
        manifest = json.loads(body)
    except ValueError:
        # The likely cause is a plain file server with a directory index, which
        # answers HTML. Said plainly, because "Expecting value: line 1 column 1"
        # sends somebody looking at the wrong thing.
        raise not_a_manifest from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), list):
        raise not_a_manifest
    if not manifest["files"]:
        raise FetchError(f"{source} holds no files")
    entries, seen = Manifest(), set()
    entries.torrent = _torrent_of(manifest, source)
    for item in manifest["files"]:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise not_a_manifest
        name = item["name"]
        # Rejected rather than joined: a name with a separator in it would
        # write outside the directory the mirror said it was in.
        problem = plain_name_problem(name)
        if problem is not None:
            raise FetchError(f"{source}: the mirror offered a file named {name!r}, which is refused: {problem}")
        if name in seen:
            raise FetchError(f"{source}: the mirror offered a file named {name!r} twice")
        seen.add(name)
        size = item.get("bytes")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise FetchError(f"{source}: the mirror gave no size for {name!r}")
        sha = item.get("sha256") or ""
        if not isinstance(sha, str) or (sha and not SHA256.match(sha.lower())):
            raise FetchError(f"{source}: the mirror gave {name!r} a sha256 that is not one")
        entries.append(Entry(name, size, sha.lower()))
    return entries


def _not_ready(source: str, response: requests.Response) -> NotReady | None:
    """The mirror's "not ready yet" (503 with `"ready": false`), or None for any other 503."""
    try:
        said = json.loads(response.raw.read(MANIFEST_LIMIT, decode_content=True) or b"{}")
    except Exception:  # not JSON, or the connection went: an ordinary 503
        return None
    if not isinstance(said, dict) or said.get("ready") is not False:
        return None
    why = said.get("error") if isinstance(said.get("error"), str) else "it is not whole yet"
    return NotReady(f"{source} is not ready on the mirror: {why}", retry_after_of(response))


def describe(error: Exception) -> str:
    if isinstance(error, requests.ConnectionError):
        return "could not connect or the connection was dropped"
    if isinstance(error, requests.Timeout):
        return "timed out"
    return str(error) or error.__class__.__name__
