"""How a node's fetch finds its sources fast (issue 24): several connections to the mirror, peers at once.

A real byte listener (gunicorn, the tracker on the tests' Redis) and real libtorrent sessions on
loopback: the byte listener serves a version's files under aliases too (`/.seed/<n>/...`, one
web seed URL, so one connection, each), a fetch offers LLMGW_FETCH_CONNECTIONS of them and
only one once a peer holds the set, and a node fetching announces every second, so a peer that
turns up after the fetch began is connected to within a second or two (not at the next 5 s round).
"""

from __future__ import annotations

import threading
import time

import pytest
import requests

from agent.peers import NodeSwarm
from contracts import credentials, signing
from contracts.swarm import Swarm, SwarmError, info_hash_of
from fleet.enrolment import issue_token

from .support.mirror import put
from .support.processes import CountingProxy, NoAuth, as_node
from .support.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

MIB = 1 << 20
WEIGHTS = bytes(range(256)) * 4096  # 1 MiB


def files_of(version: str, mib: int = 1) -> dict[str, bytes]:
    return {"a.bin": version.encode() + WEIGHTS * mib, "b.bin": WEIGHTS[::-1] + version.encode()}


def torrent_of(byte_listener: str, version: str) -> bytes:
    got = wait_until(
        lambda: (r := as_node.get(f"{byte_listener}m/{version}/?torrent", timeout=10)).status_code == 200 and r,
        what=f"the mirror's torrent of m/{version}/",
    )
    return got.content


@pytest.fixture
def node_swarm(tmp_path, byte_listener, settings, redis_client):
    """This test process as a node's libtorrent session (what `python -m agent.peers` runs), on loopback."""
    settings.BYTES_URL = byte_listener
    made = []

    def make(bytes_url: str = byte_listener) -> NodeSwarm:
        settings.BYTES_URL = bytes_url
        made.append(NodeSwarm(tmp_path / "cache", 0, "127.0.0.1"))
        return made[-1]

    yield make
    for one in made:
        one.close()


@pytest.fixture
def seeder(tmp_path):
    """A plain libtorrent session on loopback seeding a version straight from the mirror's directory."""
    made = []

    def make(torrent: bytes, directory) -> Swarm:
        made.append(Swarm(0, "127.0.0.1"))
        made[-1].seed(torrent, directory)
        return made[-1]

    yield make
    for one in made:
        one.close()


def announce_as(byte_listener: str, node: str, token: str, info_hash: str, port: int) -> None:
    """What another node's session tells the tracker: it holds the torrent, on this port."""
    node_pass = credentials.bytes_pass(signing.token_hash(token), node)
    answer = requests.get(
        byte_listener + "announce",
        params={"info_hash": info_hash, "port": str(port), "host": "127.0.0.1"},
        headers=credentials.bearer(node_pass),
        timeout=10,
    )
    assert answer.status_code == 200, answer.text


def test_a_seed_alias_serves_exactly_what_the_plain_address_serves_and_only_with_a_pass(byte_listener, mirror_root):
    put(mirror_root, "m", "v1", files_of("v1"))
    for path in ("m/v1/a.bin", ".seed/1/m/v1/a.bin", ".seed/7/m/v1/a.bin"):
        whole = as_node.get(byte_listener + path, timeout=10)
        assert whole.status_code == 200 and whole.content == files_of("v1")["a.bin"], path
        ranged = as_node.get(byte_listener + path, headers={"Range": "bytes=10-19"}, timeout=10)
        assert ranged.status_code == 206 and ranged.content == files_of("v1")["a.bin"][10:20], path
        assert ranged.headers["ETag"] == whole.headers["ETag"]
        stranger = requests.get(byte_listener + path, auth=NoAuth(), timeout=10)
        assert stranger.status_code == 401 and stranger.json()["error"].startswith("the byte listener serves only")
    # What the plain address does not have, no alias has either.
    for path in (".seed/1/m/v1/nope.bin", ".seed/1/m/v9/a.bin", ".seed/x/m/v1/a.bin", ".seed/1/m/v1/"):
        assert as_node.get(byte_listener + path, timeout=10).status_code == 404, path


def test_a_fetch_offers_the_mirror_as_several_urls_and_as_one_once_a_peer_holds_the_set(
    byte_listener, mirror_root, node_swarm, seeder, settings, tmp_path
):
    settings.FETCH_CONNECTIONS = 3
    # 12 pieces of 4 MiB and more: enough for three connections (agent.peers.PIECES_PER_CONNECTION).
    big = {version: files_of(version, mib=44) for version in ("v1", "v2")}
    for version, files in big.items():
        put(mirror_root, "m", version, files)
    node = node_swarm()

    def fetch(version: str) -> tuple[dict, list[set[str]]]:
        torrent = torrent_of(byte_listener, version)
        key = info_hash_of(torrent)
        offered: list[set[str]] = []

        def progress(status) -> None:
            handle = node.swarm.handle(key)
            offered.append({u.split("@", 1)[1] for u in handle.url_seeds()})

        done = node.fetch(torrent, tmp_path / version, f"{byte_listener}m/{version}/", False, progress)
        for name, data in big[version].items():
            assert (tmp_path / version / name).read_bytes() == data, name
        return done, offered

    # No peer: the byte listener under three addresses, its own and two aliases, each a connection.
    host = byte_listener.split("//", 1)[1]
    _, offered = fetch("v1")
    assert offered and offered[0] == {f"{host}m/", f"{host}.seed/1/m/", f"{host}.seed/2/m/"}, offered
    # Another node holds v2 (the tracker says so): the mirror is asked over one connection only.
    torrent = torrent_of(byte_listener, "v2")
    other = seeder(torrent, mirror_root / "m" / "v2")
    announce_as(byte_listener, "peer", issue_token("peer"), info_hash_of(torrent), other.listen_port)
    _, offered = fetch("v2")
    assert offered and all(urls == {f"{host}m/"} for urls in offered), offered


def test_a_peer_that_turns_up_after_a_fetch_began_is_connected_to_within_seconds(
    byte_listener, mirror_root, node_swarm, seeder, tmp_path
):
    directory = put(mirror_root, "m", "v3", files_of("v3"))
    torrent = torrent_of(byte_listener, "v3")
    key = info_hash_of(torrent)
    # The mirror, as this node reaches it, takes the files' requests and answers none: the fetch
    # can only complete from a peer.
    proxy = CountingProxy(byte_listener)
    proxy.hold = lambda client, path, range_: path.rsplit("/", 1)[-1].endswith(".bin")
    node = node_swarm(proxy.url)
    began = threading.Event()
    result: dict = {}

    def fetch() -> None:
        try:
            result["done"] = node.fetch(
                torrent, tmp_path / "got", f"{proxy.url}m/v3/", False, lambda status: began.set(), stall_s=30
            )
        except Exception as error:  # said by the assertions below
            result["error"] = error

    thread = threading.Thread(target=fetch, daemon=True)
    try:
        thread.start()
        assert began.wait(30), f"the fetch did not start: {result}"
        other = seeder(torrent, directory)
        announce_as(byte_listener, "peer", issue_token("peer"), key, other.listen_port)
        announced = time.monotonic()

        def connected() -> bool:
            infos = node.swarm.handle(key).get_peer_info() if node.swarm.handle(key) else []
            return "done" in result or any(p.ip[1] == other.listen_port for p in infos)

        wait_until(connected, 30, what=f"the fetch to connect to the peer: {result}", interval=0.1)
        # Every second while it fetches (it announced at its start, and the peer was not there yet);
        # not at the next 5 s round, and its peers read every second, not every 5 s.
        waited = time.monotonic() - announced
        assert waited < 4, f"{waited:.1f} s after the peer announced"
        thread.join(30)
    finally:
        proxy.hold = None
        thread.join(30)
        proxy.stop()
    assert "done" in result, result
    assert result["done"]["bytes_from_peers"] >= sum(map(len, files_of("v3").values())), result
    for name, data in files_of("v3").items():
        assert (tmp_path / "got" / name).read_bytes() == data, name


def test_an_address_the_filter_refuses_is_told_at_once(byte_listener, mirror_root, tmp_path):
    directory = put(mirror_root, "m", "v4", files_of("v4"))
    torrent = torrent_of(byte_listener, "v4")
    refused: list[str] = []
    guarded = Swarm(0, "127.0.0.1", on_refused=refused.append)
    stranger = Swarm(0, "127.0.0.1")
    try:
        guarded.allow(["10.255.255.1"])  # some node; not 127.0.0.1, where the stranger connects from
        guarded.seed(torrent, directory)

        def fetch() -> None:
            with pytest.raises(SwarmError, match="no source answered"):
                stranger.fetch(
                    torrent, tmp_path / "got", peers=[("127.0.0.1", guarded.listen_port)], stall_s=1, give_up_s=3
                )

        fetching = threading.Thread(target=fetch, daemon=True)
        fetching.start()
        # A node that just joined knocks: its address is told to the caller (who asks the tracker anew).
        wait_until(lambda: "127.0.0.1" in refused, 10, what="the refused address to be told")
        fetching.join(10)
    finally:
        stranger.close()
        guarded.close()


def test_one_slow_connection_of_the_mirror_is_not_a_stalled_mirror(byte_listener, fleet_node, mirror_root, tmp_path):
    put(mirror_root, "m", "v5", files_of("v5"))
    torrent = torrent_of(byte_listener, "v5")
    # Every answer paced, and the alias .seed/1 answering nothing at all: the mirror as a whole sends
    # well over the floor, one of its connections nothing.
    proxy = CountingProxy(byte_listener, rate=256 << 10)
    proxy.hold = lambda client, path, range_: path.startswith("/.seed/1/")
    fetcher = Swarm(0, "127.0.0.1")
    events: list[str] = []
    try:
        name, token = fleet_node
        signed = proxy.url.replace("//", f"//{name}:{credentials.bytes_pass(signing.token_hash(token), name)}@")
        seeds = [f"{signed}m/", f"{signed}.seed/1/m/", f"{signed}.seed/2/m/"]
        done = fetcher.fetch(
            torrent,
            tmp_path / "got",
            web_seeds=seeds,
            progress=lambda status: events.extend(status.events),
            stall_bytes_s=64 << 10,
            stall_s=1,
        )
    finally:
        proxy.hold = None
        fetcher.close()
        proxy.stop()
    assert done.seconds > 2, "over before a stall could be seen"
    assert done.stalled == [] and not [e for e in events if "sent less than" in e], (done, events)
    for name, data in files_of("v5").items():
        assert (tmp_path / "got" / name).read_bytes() == data, name
