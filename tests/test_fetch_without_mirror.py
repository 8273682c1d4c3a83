"""Issue 38 item 1 over hosts as network namespaces: with the byte listener's host gone, nodes fetch from their peers.

Redis and the byte listener on a bridge (tests/fleet_netns.py, as tests/test_swarm_fleet.py has them, and its
small weights rather than the demo model: the same path, in seconds), and three nodes. n1 fetches two versions
from the mirror; then the byte listener is SIGKILLed and the proxy the nodes reach it through is stopped (the
host gone: every connection refused). The manifest, the torrent and the peers then come from what the byte
listener wrote into Redis; the bytes from n1 alone, each piece verified by the torrent's hashes and each file
by the manifest's sha256 before `.complete`.

1. n2 and n3 fetch v1 whole from n1, byte-identical to the mirror's, nothing from the mirror;
2. n1's copy of v2 rots (one byte flipped, size and mtime kept): n2 fetching it from n1 alone finds the
   piece's hash wrong, bans n1, and never marks the set complete;
3. v2's manifest in Redis is changed (another sha256, as anyone who can write to Redis could): n3 refuses it,
   for it no longer carries the byte listener's MAC for n3 (the tracker adds one per node, keyed by its token hash).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal

import pytest
import redis

from . import netns

if reason := netns.unavailable():
    pytest.skip(reason, allow_module_level=True)

from agent.fetch import cache_path  # noqa: E402
from contracts import keys  # noqa: E402

from .support.database import db_access  # noqa: E402, F401  (a fixture)
from .support.fleet import send_fetch  # noqa: E402
from .support.swarm_fleet import (  # noqa: E402
    assert_same_as_the_mirror,
    fetched,
    progress_of,
    source_of,
    swarm_fleet_on_a_bridge,
)
from .support.waiting import wait_until  # noqa: E402

MIB = 1 << 20
VERSIONS = {"v1": {"a.bin": 10 * MIB + 3, "b.bin": 6 * MIB, "config.json": 100}, "v2": {"c.bin": 9 * MIB}}


@pytest.fixture(scope="module")
def fleet_without_mirror(db_access, tmp_path_factory):  # noqa: F811  (the fixture imported above)
    with swarm_fleet_on_a_bridge(tmp_path_factory.mktemp("no-mirror-netns"), VERSIONS) as (_, control, nodes):
        for version in VERSIONS:
            send_fetch("n1", source_of(control, version), broker_url=control.redis_url)
        for version in VERSIONS:
            fetched(control, nodes["n1"], version)
        client = redis.Redis.from_url(control.redis_url, socket_timeout=5)
        for version in VERSIONS:
            assert client.hget(keys.swarm_version_key("tiny", version), "info_hash")
        # Every node known to the tracker before it goes: a node's peers let in only the fleet's addresses,
        # and who the fleet is is the tracker's word (a node that never announced is nobody's peer).
        wait_until(
            lambda: {b"n1", b"n2", b"n3"} <= set(client.hkeys(keys.SWARM_FLEET)),
            30,
            what=lambda: f"every node to announce: {client.hkeys(keys.SWARM_FLEET)}",
        )
        # And n1 in the tracker's records as holding both (its announce after each `.complete`).
        hashes = [client.hget(keys.swarm_version_key("tiny", v), "info_hash").decode() for v in VERSIONS]
        wait_until(
            lambda: all(client.hexists(keys.SWARM_PREFIX + h, "n1") for h in hashes),
            30,
            what="the tracker to name n1 as holding both versions",
        )
        # And the tracker's word on each version for each node (at its next announce): what a node believes them by.
        wanted = {f"mac:{name}".encode() for name in nodes}
        wait_until(
            lambda: all(wanted <= set(client.hkeys(keys.swarm_version_key("tiny", v))) for v in VERSIONS),
            30,
            what=lambda: f"every node's MAC on the versions: {client.hkeys(keys.swarm_version_key('tiny', 'v1'))}",
        )
        # The byte listener's host gone: its process killed, and nothing listening where the nodes reach it.
        os.killpg(control.byte_listener.popen.pid, signal.SIGKILL)
        control.proxy.stop()
        yield control, nodes


def test_with_the_byte_listener_killed_two_more_nodes_fetch_the_set_whole_from_the_first(fleet_without_mirror):
    control, nodes = fleet_without_mirror
    for name in ("n2", "n3"):
        send_fetch(name, source_of(control, "v1"), broker_url=control.redis_url)
    total = sum(VERSIONS["v1"].values())
    for name in ("n2", "n3"):
        said = fetched(control, nodes[name], "v1")
        assert_same_as_the_mirror(control, nodes[name], "v1")
        assert said["bytes_from_peers"] >= total and said["bytes_from_mirror"] == 0, said


def test_with_the_byte_listener_killed_a_peer_serving_wrong_bytes_is_banned_and_the_set_never_complete(
    fleet_without_mirror,
):
    control, nodes = fleet_without_mirror
    rotten = cache_path(source_of(control, "v2"), nodes["n1"].cache) / "c.bin"
    st = rotten.stat()
    with open(rotten, "r+b") as fh:
        fh.seek(5 * MIB)
        byte = fh.read(1)
        fh.seek(5 * MIB)
        fh.write(bytes([byte[0] ^ 0xFF]))
    os.utime(rotten, ns=(st.st_atime_ns, st.st_mtime_ns))  # as verified: n1 seeds it without looking again
    source = source_of(control, "v2")
    send_fetch("n2", source, broker_url=control.redis_url)
    wait_until(
        lambda: "failed its hash and is banned" in nodes["n2"].agent.output(),
        60,
        what=lambda: f"n2 to ban n1 for a bad piece: {progress_of(control, nodes['n2'], source)}\n"
        f"{nodes['n2'].agent.output()[-3000:]}",
    )
    directory = cache_path(source, nodes["n2"].cache)
    assert not (directory / ".complete").exists()
    assert progress_of(control, nodes["n2"], source).get("state") != "complete"


def test_with_the_byte_listener_killed_a_manifest_changed_in_redis_is_refused_with_a_sentence(fleet_without_mirror):
    control, nodes = fleet_without_mirror
    client = redis.Redis.from_url(control.redis_url, socket_timeout=5)
    key = keys.swarm_version_key("tiny", "v2")
    manifest = json.loads(client.hget(key, "manifest"))
    # Whoever can write to Redis (a node, with one shared password) names other bytes for c.bin: its own.
    manifest["files"][0]["sha256"] = hashlib.sha256(b"other weights").hexdigest()
    client.hset(key, "manifest", json.dumps(manifest))
    source = source_of(control, "v2")
    send_fetch("n3", source, broker_url=control.redis_url)
    wait_until(
        lambda: "does not carry the byte listener's word for this node"
        in progress_of(control, nodes["n3"], source).get("error", ""),
        60,
        what=lambda: f"n3 to refuse the changed manifest: {progress_of(control, nodes['n3'], source)}",
    )
    assert not (cache_path(source, nodes["n3"].cache) / ".complete").exists()
