"""The tracker on the byte listener: which enrolled nodes hold which torrent (issue 24).

Served beside the mirror's files (llmgw_site/urls_bytes.py) and refused the same way
(`bytes_views._error`); kept apart by topic from the files themselves.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import json
import re
import time

import redis
from django.conf import settings
from django.http import HttpRequest, JsonResponse
from django.utils.crypto import constant_time_compare, salted_hmac

from contracts import keys
from contracts.redis_client import redis_client
from contracts.sources import version_mac

from .bytes_views import _error

SWARM_PREFIX = keys.SWARM_PREFIX
SWARM_FLEET = keys.SWARM_FLEET
# The torrents a node said it holds at its last announce: what its next one takes back.
SWARM_HELD = "llmgw:swarm-held:"
SWARM_RATE = "llmgw:swarm-rate:"
# A node announces every few seconds while it fetches or seeds; one silent this long is gone.
PEER_TTL_S = 30
ANNOUNCE_INTERVAL_S = 5
INFO_HASH = re.compile(r"^[0-9a-f]{64}$")
# A node names every torrent it holds or fetches in one announce; more than this is refused, and a
# node's records in Redis are those of its last announce only, so no node makes more keys than this.
# 100 info-hashes are a request line of about 7,500 bytes, within what the byte listener's gunicorn
# reads (--limit-request-line 8190, its most); agent/peers.py names at most this many.
MAX_INFO_HASHES = 100
# A node announces every second while it fetches (agent/peers.py), and at a fetch's start: this
# many in RATE_WINDOW_S leaves it room, and a node (or a stolen pass) asking faster gets 429.
ANNOUNCES_PER_WINDOW = 10
RATE_WINDOW_S = 5


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


def peer_address(request: HttpRequest) -> str:
    """The address this request came from: the connection's, or, from a trusted proxy (LLMGW_BYTES_TRUSTED_PROXIES),
    the one the proxy says it came from (the last X-Forwarded-For entry, the one that proxy added)."""
    remote = request.META.get("REMOTE_ADDR", "")
    try:
        address = ipaddress.ip_address(remote)
    except ValueError:
        return ""
    if any(address in network for network in settings.BYTES_TRUSTED_PROXIES):
        forwarded = request.headers.get("X-Forwarded-For", "").rsplit(",", 1)[-1].strip()
        try:
            return str(ipaddress.ip_address(forwarded))
        except ValueError:
            return ""
    return str(address)


def _vouch(client, node: str, key: str | None) -> None:
    """The node's MAC over every version in Redis whose MAC is missing or stale (issue 38): what lets it believe
    their manifests and torrents there when this listener is gone. One round trip to read, one to write if any."""
    if not key:
        return
    versions = sorted(v.decode() if isinstance(v, bytes) else v for v in client.smembers(keys.SWARM_VERSIONS))
    pipe = client.pipeline()
    for name in versions:
        pipe.hmget(keys.swarm_version_key(*name.split("/", 1)), "digest", f"mac:{node}")
    write = client.pipeline()
    for name, (digest, mac) in zip(versions, pipe.execute(), strict=True):
        if digest is None:
            write.srem(keys.SWARM_VERSIONS, name)  # gone from Redis
            continue
        model, version = name.split("/", 1)
        wanted = version_mac(key, node, model, version, digest.decode())
        if (mac or b"").decode() != wanted:
            write.hset(keys.swarm_version_key(model, version), f"mac:{node}", wanted)
    if len(write):
        write.execute()


def _record_mac(info_hash: str, node: str, host: str, port: int, at: float) -> str:
    # Redis is writable by every holder of its password: a record is believed only if the byte listener made it.
    return salted_hmac("llmgw.tracker", f"{info_hash}|{node}|{host}|{port}|{at!r}").hexdigest()


def _record(info_hash: str, node: str, host: str, port: int, at: float) -> str:
    return json.dumps({"host": host, "port": port, "at": at, "mac": _record_mac(info_hash, node, host, port, at)})


def _read_announce(request: HttpRequest, nodes) -> tuple[str, list[str], int, str] | JsonResponse:
    """An announce's node, info-hashes, peer port and address; or the refusal that says what is wrong with it."""
    if request.method != "GET":
        return _error(405, "the tracker answers GET only", Allow="GET")
    node = _node_of(request)
    if not node or not nodes.token_hash_of(node):
        return _error(401, "the tracker answers only the fleet's nodes, each with its own pass")
    hashes = list(dict.fromkeys(request.GET.getlist("info_hash")))
    if len(hashes) > MAX_INFO_HASHES:
        return _error(400, f"an announce names at most {MAX_INFO_HASHES} torrents, not {len(hashes)}")
    if not hashes or not all(INFO_HASH.match(h) for h in hashes):
        return _error(400, "info_hash must be a torrent's v2 info-hash, 64 hex digits (one or more)")
    port = request.GET.get("port", "")
    if not port.isdigit() or not 0 < int(port) < 65536:
        return _error(400, "port must be the node's peer port, 1 to 65535")
    host = nodes.many([node]).get(node, ("", ""))[1] or peer_address(request)
    if not host:
        return _error(400, "the tracker cannot tell this node's address from its request")
    return node, hashes, int(port), host


def _said(info_hash: str, raw: dict, now: float) -> dict[str, dict]:
    """The peer records of one torrent (or the fleet, "") that the byte listener made and are still fresh."""
    out = {}
    for name, value in raw.items():
        name = name.decode() if isinstance(name, bytes) else name
        try:
            record = json.loads(value)
            where, on, at = str(record["host"]), int(record["port"]), float(record["at"])
            genuine = constant_time_compare(str(record["mac"]), _record_mac(info_hash, name, where, on, at))
        except (ValueError, KeyError, TypeError):
            continue
        if genuine and now - at <= PEER_TTL_S:
            out[name] = {"host": where, "port": on}
    return out


def _replace_records(client, node: str, host: str, port: int, hashes: list[str], before, now: float) -> list:
    """The node's peer records made anew for the torrents it names (those it named before and not now go);
    returns the fleet's records and each torrent's, as Redis holds them after this announce."""
    pipe = client.pipeline()
    # What the node held at its last announce and no longer names: its records there go.
    for gone in {b.decode() if isinstance(b, bytes) else b for b in before} - set(hashes):
        pipe.hdel(SWARM_PREFIX + gone, node)
    pipe.delete(SWARM_HELD + node)
    pipe.sadd(SWARM_HELD + node, *hashes)
    pipe.expire(SWARM_HELD + node, 10 * PEER_TTL_S)
    pipe.hset(SWARM_FLEET, node, _record("", node, host, port, now))
    for h in hashes:
        pipe.hset(SWARM_PREFIX + h, node, _record(h, node, host, port, now))
        pipe.expire(SWARM_PREFIX + h, 10 * PEER_TTL_S)
    pipe.hgetall(SWARM_FLEET)
    for h in hashes:
        pipe.hgetall(SWARM_PREFIX + h)
    return pipe.execute()[-(len(hashes) + 1) :]


def announce(request: HttpRequest, nodes) -> JsonResponse:
    """`/announce?info_hash=H&port=P`: this node holds (or fetches) torrent H on port P; who else does.

    Peers are found here, through the control plane, never by DHT: the answer names only
    nodes whose enrolment token is current (`nodes`, fleet.enrolment.EnrolledNodes: cached
    for LLMGW_BYTES_PASS_CACHE_S, all the nodes of an answer read in one query), so a revoked
    node drops out of every answer within seconds. `fleet` is every enrolled node that
    announced lately, whatever it holds: the addresses a node lets connect to its peer port.

    A node's address is the one fixed at its enrolment if it has one, else the address its
    announce came from (a trusted proxy's word for it, `peer_address`): never one the node
    names, since every node lets the fleet's addresses in. A `host` parameter is ignored.
    """
    asked = _read_announce(request, nodes)
    if isinstance(asked, JsonResponse):
        return asked
    node, hashes, port, host = asked
    now = time.time()
    client = redis_client(settings.REDIS_URL)
    try:
        pipe = client.pipeline()
        pipe.incr(SWARM_RATE + node)
        pipe.ttl(SWARM_RATE + node)
        pipe.smembers(SWARM_HELD + node)
        announced, expires, before = pipe.execute()
        if expires < 0:  # the window's first announce (or a counter left without one): the window starts now
            client.expire(SWARM_RATE + node, RATE_WINDOW_S)
        if announced > ANNOUNCES_PER_WINDOW:
            return _error(
                429,
                f"node {node} announced more than {ANNOUNCES_PER_WINDOW} times in {RATE_WINDOW_S} s; "
                "it keeps the peers it has meanwhile",
                Retry_After=str(RATE_WINDOW_S),
            )
        answers = _replace_records(client, node, host, port, hashes, before, now)
        _vouch(client, node, nodes.token_hash_of(node))
    except redis.RedisError:
        return _error(503, "the tracker cannot reach Redis; fetch from the mirror meanwhile", Retry_After="10")

    return _answer(node, hashes, answers, nodes, now)


def _answer(node: str, hashes: list[str], answers: list, nodes, now: float) -> JsonResponse:
    """The announce's answer from Redis's records: the fleet's addresses, and each torrent's other holders, all enrolled."""
    fleet_raw, *held_raw = answers
    fleet = _said("", fleet_raw, now)
    held = [_said(h, raw, now) for h, raw in zip(hashes, held_raw, strict=True)]
    # Every node this answer could name, in one lookup (one query at most, for those not cached).
    enrolled = nodes.many(set(fleet).union(*held))

    def current(records: dict[str, dict]) -> list[dict]:
        out = []
        for name, record in sorted(records.items()):
            key, address = enrolled.get(name, ("", ""))
            if key:
                out.append({"node": name, "host": address or record["host"], "port": record["port"]})
        return out

    return JsonResponse(
        {
            "interval": ANNOUNCE_INTERVAL_S,
            "fleet": [p["host"] for p in current(fleet)],
            "peers": {
                h: [p for p in current(records) if p["node"] != node] for h, records in zip(hashes, held, strict=True)
            },
        }
    )
