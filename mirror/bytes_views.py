"""The byte listener: the mirror's files, manifests and listings, GET and HEAD only.

Every node fetches from here, so it answers only what a fetch needs and every
refusal is the same short JSON sentence. Files go out through the WSGI server's
file wrapper, which gunicorn sends with sendfile(2): the bytes never pass
through Python, ranged or whole.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import json
import os
import re
import socket
import stat
import time
from email.utils import formatdate

import redis
from django.conf import settings
from django.http import FileResponse, HttpRequest, HttpResponse, JsonResponse
from django.utils.cache import get_conditional_response

from contracts.redis_client import redis_client

from . import disk, readiness, torrent
from .metrics import BYTES_SERVED, FILES_SERVED


def _error(status: int, sentence: str, **headers) -> JsonResponse:
    response = JsonResponse({"error": sentence}, status=status)
    for name, value in headers.items():
        response[name.replace("_", "-")] = value
    return response


def not_found(request: HttpRequest, exception=None, **kwargs) -> JsonResponse:
    return _error(404, "nothing here: the mirror has no such model, version or file")


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
    status = readiness.prepare(model, version, files)
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
        return JsonResponse(body)
    response = JsonResponse({**body, "ready": False, "error": status.problem}, status=503)
    response["Retry-After"] = str(status.retry_after)
    return response


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


@_only_get_and_head
def file(request: HttpRequest, model: str, version: str, name: str) -> HttpResponse:
    path = disk.resolve(model, version, name)
    if path is None:
        return not_found(request)
    try:
        fh = open(os.path.realpath(path), "rb")
    except OSError:
        return not_found(request)
    st = os.fstat(fh.fileno())
    if not stat.S_ISREG(st.st_mode):
        fh.close()
        return not_found(request)

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


# --- the tracker: which enrolled nodes hold which torrent (issue 24) -----------------

SWARM_PREFIX = "llmgw:swarm:"
SWARM_FLEET = "llmgw:swarm-fleet"
# A node announces every few seconds while it fetches or seeds; one silent this long is gone.
PEER_TTL_S = 30
ANNOUNCE_INTERVAL_S = 5
INFO_HASH = re.compile(r"^[0-9a-f]{64}$")


def _node_of(request: HttpRequest) -> str:
    """The node whose pass this request presented (checked already by `only_the_fleet`)."""
    scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
    presented = presented.strip()
    if scheme.lower() == "basic":
        try:
            presented = base64.b64decode(presented, validate=True).decode().partition(":")[2]
        except (binascii.Error, UnicodeDecodeError):
            return ""
    elif scheme.lower() != "bearer":
        return ""
    return presented.partition(":")[0]


def announce(request: HttpRequest, key_of) -> JsonResponse:
    """`/announce?info_hash=H&port=P[&host=A]`: this node holds (or fetches) torrent H on port P; who else does.

    Peers are found here, through the control plane, never by DHT: the answer names only
    nodes whose enrolment token is current at this moment (`key_of`), so a revoked node
    drops out of every answer at once. `fleet` is every enrolled node that announced
    lately, whatever it holds: the addresses a node lets connect to its peer port. The
    host is what the node advertises (LLMGW_ENGINE_ADVERTISE), else the address it asked from.
    """
    if request.method != "GET":
        return _error(405, "the tracker answers GET only", Allow="GET")
    node = _node_of(request)
    if not node or not key_of(node):
        return _error(401, "the tracker answers only the fleet's nodes, each with its own pass")
    hashes = request.GET.getlist("info_hash")
    if not hashes or not all(INFO_HASH.match(h) for h in hashes) or len(hashes) > 1000:
        return _error(400, "info_hash must be a torrent's v2 info-hash, 64 hex digits (one or more)")
    port = request.GET.get("port", "")
    if not port.isdigit() or not 0 < int(port) < 65536:
        return _error(400, "port must be the node's peer port, 1 to 65535")
    host = request.GET.get("host") or request.META.get("REMOTE_ADDR", "")
    try:
        host = str(ipaddress.ip_address(host))
    except ValueError:
        return _error(400, f"host must be the node's address (an IP address), not {host!r}")
    now = time.time()
    me = json.dumps({"host": host, "port": int(port), "at": now})
    client = redis_client(settings.REDIS_URL)
    try:
        pipe = client.pipeline()
        pipe.hset(SWARM_FLEET, node, me)
        for h in hashes:
            pipe.hset(SWARM_PREFIX + h, node, me)
            pipe.expire(SWARM_PREFIX + h, 10 * PEER_TTL_S)
        pipe.hgetall(SWARM_FLEET)
        for h in hashes:
            pipe.hgetall(SWARM_PREFIX + h)
        answers = pipe.execute()[-(len(hashes) + 1) :]
    except redis.RedisError:
        return _error(503, "the tracker cannot reach Redis; fetch from the mirror meanwhile", Retry_After="10")
    enrolled: dict[str, bool] = {}

    def current(raw: dict) -> list[dict]:
        out = []
        for name, value in raw.items():
            name = name.decode() if isinstance(name, bytes) else name
            try:
                said = json.loads(value)
            except ValueError:
                continue
            if now - said.get("at", 0) > PEER_TTL_S:
                continue
            if name not in enrolled:
                enrolled[name] = bool(key_of(name))
            if enrolled[name]:
                out.append({"node": name, "host": said["host"], "port": said["port"]})
        return sorted(out, key=lambda p: p["node"])

    fleet, *held = answers
    return JsonResponse(
        {
            "interval": ANNOUNCE_INTERVAL_S,
            "fleet": [p["host"] for p in current(fleet)],
            "peers": {h: [p for p in current(raw) if p["node"] != node] for h, raw in zip(hashes, held, strict=True)},
        }
    )
