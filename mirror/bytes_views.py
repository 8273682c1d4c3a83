"""The byte listener: the mirror's files, manifests and listings, GET and HEAD only.

Every node fetches from here, so it answers only what a fetch needs and every
refusal is the same short JSON sentence. Files go out through the WSGI server's
file wrapper, which gunicorn sends with sendfile(2): the bytes never pass
through Python, ranged or whole.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import stat
from email.utils import formatdate
from pathlib import Path

import gevent
import redis
from django.conf import settings
from django.core.exceptions import DisallowedHost
from django.db import connections
from django.http import FileResponse, HttpRequest, HttpResponse, JsonResponse
from django.utils.cache import get_conditional_response
from gevent import monkey

from contracts import keys
from contracts.names import plain_name_problem
from contracts.redis_client import redis_client
from contracts.sources import version_digest

from . import disk, readiness, torrent
from .metrics import BYTES_SERVED, FILES_SERVED

log = logging.getLogger(__name__)


def _error(status: int, sentence: str, **headers) -> JsonResponse:
    response = JsonResponse({"error": sentence}, status=status)
    for name, value in headers.items():
        response[name.replace("_", "-")] = value
    return response


def not_found(request: HttpRequest, exception=None, **kwargs) -> JsonResponse:
    return _error(404, "nothing here: the mirror has no such model, version or file")


def bad_request(request: HttpRequest, exception=None, **kwargs) -> JsonResponse:
    if isinstance(exception, DisallowedHost):
        # Manifests give addresses built from the Host a node sends: another name would send nodes astray.
        host = request.META.get("HTTP_HOST", "")[:200]
        return _error(
            400,
            f"this byte listener answers to {', '.join(settings.ALLOWED_HOSTS)} only, not the Host {host!r}: "
            "nodes reach it at the address in their LLMGW_BYTES_URL, and its host is the one allowed "
            "(LLMGW_BYTES_URL here, or LLMGW_BYTES_ALLOWED_HOSTS)",
        )
    return _error(400, "the byte listener could not read this request")


def server_error(request: HttpRequest) -> JsonResponse:
    return _error(500, "the byte listener failed to answer; its log says why")


def _only_get_and_head(view):
    # Not Django's require_safe: its 405 has no body, and every refusal here is a JSON sentence.
    def wrapped(request: HttpRequest, *args, **kwargs):
        if request.method not in ("GET", "HEAD"):
            return _error(405, "the byte listener answers GET and HEAD only", Allow="GET, HEAD")
        return view(request, *args, **kwargs)

    wrapped.__name__ = view.__name__
    wrapped.__doc__ = view.__doc__
    return wrapped


@_only_get_and_head
def model_list(request: HttpRequest) -> JsonResponse:
    base = request.build_absolute_uri("/")
    return JsonResponse({"models": [{"name": m, "url": f"{base}{m}/"} for m in disk.model_names()]})


@_only_get_and_head
def version_list(request: HttpRequest, model: str) -> JsonResponse:
    if disk.resolve(model) is None or model not in disk.model_names():
        return not_found(request)
    base = request.build_absolute_uri(f"/{model}/")
    versions = [{"version": v, "url": f"{base}{v}/"} for v in disk.version_names(model)]
    return JsonResponse({"model": model, "versions": versions})


@_only_get_and_head
def manifest(request: HttpRequest, model: str, version: str) -> JsonResponse:
    """What a version consists of, built from the directory at this moment.

    Not from a file written beside the weights, and not from the index: both are
    second records that disagree the first time somebody copies a file in by hand.
    The index only lends a sha256, and only for a file whose size and mtime are
    the ones that were hashed.

    Offered whole or not at all: a version with a file still being written, or one
    whose sha256 is not known yet, is answered 503 with `Retry-After`, `"ready":
    false` and the sentence why (`readiness.prepare`); nodes wait on it.
    """
    if model not in disk.model_names():
        return not_found(request)
    files = disk.version_files(model, version)
    if files is None:
        return not_found(request)
    status = _off_the_event_loop(readiness.prepare, model, version, files)
    entries = []
    for f in files:
        entry = {"name": f.name, "bytes": f.bytes}
        if f.name in status.hashes:
            entry["sha256"] = status.hashes[f.name]
        entries.append(entry)
    body = {"model": model, "version": version, "files": entries, "bytes": sum(f.bytes for f in files)}
    if status.ready and status.info_hash:
        body["torrent"] = {
            "info_hash": status.info_hash,
            "url": request.build_absolute_uri(request.path) + "?torrent",
            "piece_bytes": torrent.PIECE_BYTES,
        }
    if status.ready and "torrent" in request.GET:
        return _torrent(model, version, files, status)
    if status.ready:
        if status.info_hash:
            _publish(model, version, files, status, body)
        return JsonResponse(body)
    _forget_if_changed(model, version, files, status)
    response = JsonResponse({**body, "ready": False, "error": status.problem}, status=503)
    response["Retry-After"] = str(status.retry_after)
    return response


def _off_the_event_loop(function, *args):
    """function(*args) in a thread of gevent's pool where the byte listener runs under gevent, else here.

    A manifest may hash up to LLMGW_MIRROR_HASH_INLINE_BYTES and make a torrent: on the event
    loop, every connection of the worker (downloads, other nodes' pass checks) would wait
    for it. The thread's database connection is closed when it is done: nothing closes it else.
    """
    if not monkey.is_module_patched("socket"):
        return function(*args)

    def run():
        try:
            return function(*args)
        finally:
            connections.close_all()

    return gevent.get_hub().threadpool.apply(run)


def _publish(model: str, version: str, files: list[disk.DiskFile], status: readiness.Readiness, body: dict) -> None:
    """The version's manifest and torrent into Redis, where nodes read them when this listener is gone (issue 38).

    Written when the torrent there is not this one (a first fetch, a version changed since),
    so a version asked for often costs one HGET. Redis away: the manifest is answered all the
    same; the copy is written at the next request.
    """
    key = keys.swarm_version_key(model, version)
    client = redis_client(settings.REDIS_URL)
    try:
        held = client.hget(key, "info_hash")
        if (held.decode() if isinstance(held, bytes) else held) == status.info_hash:
            return
        data = torrent.stored(model, version, [(f.name, f.bytes, status.hashes[f.name]) for f in files])
        if data is None:
            return
        manifest = {k: v for k, v in body.items() if k != "torrent"}
        manifest["torrent"] = {"info_hash": status.info_hash, "piece_bytes": torrent.PIECE_BYTES}
        said = json.dumps(manifest).encode()
        digest = version_digest(said, status.info_hash, data)
        pipe = client.pipeline()
        # Each node's MAC over it is added at the node's next announce (`_vouch`): the old ones go with the old version.
        pipe.delete(key)
        pipe.hset(key, mapping={"manifest": said, "torrent": data, "info_hash": status.info_hash, "digest": digest})
        pipe.sadd(keys.SWARM_VERSIONS, f"{model}/{version}")
        pipe.execute()
    except redis.RedisError as error:
        log.warning("the manifest of %s/%s is not in Redis for now: %s", model, version, error)


def _forget_if_changed(model: str, version: str, files: list[disk.DiskFile], status: readiness.Readiness) -> None:
    """The copy of a version's manifest in Redis deleted when the files on disk are no longer the ones it lists.

    A version being copied in again (or changed by hand) is not ready; its old copy would
    otherwise be what a node is given when this listener cannot answer (`agent.sources.read_manifest`),
    and the node would fetch from its peers a set the mirror no longer holds. Changed means another
    name or size, a file still being written, or a known sha256 that is not the copy's; a version
    not ready only because the index cannot be read keeps its copy. Redis away: said, and the copy
    is replaced when the version is next served whole.
    """
    key = keys.swarm_version_key(model, version)
    try:
        client = redis_client(settings.REDIS_URL)
        said = client.hget(key, "manifest")
        if said is None:
            return
        try:
            kept = {f["name"]: (f["bytes"], f.get("sha256", "")) for f in json.loads(said)["files"]}
        except (ValueError, KeyError, TypeError, AttributeError):
            kept = None
        changed = (
            kept is None
            or set(kept) != {f.name for f in files}
            or any(kept[f.name][0] != f.bytes for f in files)
            or any(kept[name][1] != sha for name, sha in status.hashes.items() if name in kept)
            or readiness.being_written(files) is not None
        )
        if changed:
            pipe = client.pipeline()
            pipe.delete(key)
            pipe.srem(keys.SWARM_VERSIONS, f"{model}/{version}")
            pipe.execute()
    except redis.RedisError as error:
        log.warning("the copy of %s/%s's manifest in Redis may be out of date: %s", model, version, error)


def _torrent(model: str, version: str, files: list[disk.DiskFile], status: readiness.Readiness) -> HttpResponse:
    """`/<model>/<version>/?torrent`: the version's v2 torrent, for exactly the files the manifest gives now."""
    data = torrent.stored(model, version, [(f.name, f.bytes, status.hashes[f.name]) for f in files])
    if data is None:
        return _error(503, f"the torrent of {model}/{version}/ is still being computed", Retry_After="5")
    response = HttpResponse(data, content_type="application/x-bittorrent")
    response["Content-Disposition"] = f'attachment; filename="{version}.torrent"'
    return response


class _RangeFile:
    """An open file limited to [start, start+length), for the file wrapper.

    gunicorn's sendfile path reads the descriptor's offset and the response's
    Content-Length, so seeking to `start` is all zero-copy needs; `read` keeps
    any server without sendfile to the same bytes.
    """

    def __init__(self, fh, start: int, length: int, on_close=None):
        self._fh = fh
        self._left = length
        self._on_close = on_close
        fh.seek(start)

    def fileno(self) -> int:
        return self._fh.fileno()

    def read(self, size: int = -1) -> bytes:
        if self._left <= 0:
            return b""
        if size is None or size < 0 or size > self._left:
            size = self._left
        data = self._fh.read(size)
        self._left -= len(data)
        return data

    def close(self) -> None:
        self._fh.close()
        if self._on_close is not None:
            self._on_close()
            self._on_close = None


def _cork(request: HttpRequest):
    """Hold back partial segments while the file is sent; returns what lets them go.

    What nginx's tcp_nopush does: with the socket corked, the headers and the
    file leave in full segments rather than as the kernel finds them, which was
    the difference between 0.78 and about 1.0 × nginx on one stream. Uncorked
    when the response closes, so a keep-alive connection's next, small answer
    is not held for the kernel's 200 ms.
    """
    sock = request.META.get("gunicorn.socket")
    if sock is None or not hasattr(socket, "TCP_CORK"):
        return None
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 1)
    except OSError:
        return None

    def uncork() -> None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 0)
        except OSError:
            pass  # the client has gone; nothing is waiting to be sent

    return uncork


def _etag(st: os.stat_result) -> str:
    return f'"{st.st_size:x}-{st.st_mtime_ns:x}"'


def _parse_range(header: str, size: int) -> tuple[int, int] | None | str:
    """(start, end inclusive), None to ignore the header, or "unsatisfiable".

    One range only: a multi-range request is answered whole (RFC 9110 allows a
    server to ignore Range), since no fetcher of ours asks for one.
    """
    unit, _, spec = header.partition("=")
    if unit.strip().lower() != "bytes" or "," in spec:
        return None
    first, dash, last = spec.strip().partition("-")
    if not dash:
        return None
    first, last = first.strip(), last.strip()
    try:
        if first == "":
            if not last.isdigit():
                return None
            suffix = int(last)
            if suffix == 0 or size == 0:
                return "unsatisfiable"
            return max(0, size - suffix), size - 1
        if not first.isdigit() or (last and not last.isdigit()):
            return None
        start = int(first)
        end = int(last) if last else size - 1
    except ValueError:
        return None
    if start >= size:
        return "unsatisfiable"
    if end < start:
        return None
    return start, min(end, size - 1)


def _if_range_allows(request: HttpRequest, etag: str, last_modified: str) -> bool:
    """If-Range: the range applies only to the representation the client already has."""
    value = request.headers.get("If-Range")
    if value is None:
        return True
    value = value.strip()
    if value.startswith('"') or value.startswith("W/"):
        return value == etag  # strong comparison; a weak tag never matches
    return value == last_modified


def _open_servable(model: str, version: str, name: str):
    """The file at model/version/name, open, with its fstat, when it is a regular file inside the mirror; else None.

    Opened by the real path that was checked, one name at a time from the real root with
    O_NOFOLLOW: a link swapped in for any of them after the check (one to a file outside the
    mirror) is refused, not followed. Non-blocking, and fstat-ed before anything is read: a
    FIFO put in the mirror is answered 404 at once, where opening it would block the worker
    (and, under gevent, every connection it holds) until something wrote to it.
    """
    try:
        # realpath raises where a link is swapped for a file while it reads it.
        path = disk.resolve(model, version, name)
        if path is None:
            return None
        real_root = os.path.realpath(disk.root())
        parts = Path(os.path.realpath(path)).relative_to(real_root).parts
    except (OSError, ValueError):
        return None
    if len(parts) != 3 or any(plain_name_problem(part) is not None for part in parts):
        return None
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    directories: list[int] = []
    try:
        directories.append(os.open(real_root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
        for part in parts[:-1]:
            directories.append(os.open(part, flags | os.O_DIRECTORY, dir_fd=directories[-1]))
        fd = os.open(parts[-1], flags, dir_fd=directories[-1])
    except OSError:
        return None
    finally:
        for directory in directories:
            os.close(directory)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        return None
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb"), st


@_only_get_and_head
def file(request: HttpRequest, model: str, version: str, name: str) -> HttpResponse:
    opened = _open_servable(model, version, name)
    if opened is None:
        return not_found(request)
    fh, st = opened

    size = st.st_size
    etag = _etag(st)
    last_modified = formatdate(st.st_mtime, usegmt=True)
    common = {"ETag": etag, "Last-Modified": last_modified, "Accept-Ranges": "bytes"}

    # If-None-Match, If-Modified-Since (and If-Match, If-Unmodified-Since) as Django reads them.
    headers_only = HttpResponse()
    for k, v in common.items():
        headers_only[k] = v
    conditional = get_conditional_response(request, etag=etag, last_modified=int(st.st_mtime), response=headers_only)
    if conditional is not headers_only:
        fh.close()
        return conditional

    status, start, length = 200, 0, size
    range_header = request.headers.get("Range")
    if range_header and _if_range_allows(request, etag, last_modified):
        parsed = _parse_range(range_header, size)
        if parsed == "unsatisfiable":
            fh.close()
            response = _error(416, f"the range {range_header} is outside a file of {size} bytes")
            response["Content-Range"] = f"bytes */{size}"
            for k, v in common.items():
                response[k] = v
            return response
        if parsed is not None:
            first, last = parsed
            status, start, length = 206, first, last - first + 1

    if request.method == "HEAD":
        fh.close()
        response = HttpResponse(status=status, content_type="application/octet-stream")
    else:
        body = _RangeFile(fh, start, length, on_close=_cork(request))
        response = FileResponse(body, status=status, content_type="application/octet-stream")
        # Without this Django would read the file in 4 KiB blocks where there is no sendfile.
        response.block_size = 1 << 20
        BYTES_SERVED.inc(length)
        FILES_SERVED.labels(str(status)).inc()
    response["Content-Length"] = str(length)
    if status == 206:
        response["Content-Range"] = f"bytes {start}-{start + length - 1}/{size}"
    for k, v in common.items():
        response[k] = v
    return response


def seed_alias(request: HttpRequest, n: int, model: str, version: str, name: str) -> HttpResponse:
    """`/.seed/<n>/<model>/<version>/<file>`: the file, exactly as its own address serves it (contracts.sources.SEED_ALIAS).

    libtorrent opens one connection per web seed URL: a node given several of these fetches
    over several connections, where a link limits each one (issue 24).
    """
    return file(request, model, version, name)
