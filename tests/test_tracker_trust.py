"""The tracker believes no address a node names, makes no more keys than its cap, and answers a node at its pace.

A real byte listener (gunicorn + gevent) on the test database and the tests' Redis. Every
node lets the addresses in the tracker's `fleet` connect to its peer port (libtorrent's IP
filter, agent/peers.py), so an address a node could name for itself would let a stranger
in: the attacks here are a forged `host` in an announce and a peer record written straight
into Redis, and neither address may reach another node's answer (issue 33).
"""

from __future__ import annotations

import json
import time

import pytest
import requests

from contracts import credentials, signing
from fleet.enrolment import issue_token
from mirror.tracker import ANNOUNCES_PER_WINDOW, MAX_INFO_HASHES, RATE_WINDOW_S, SWARM_FLEET, SWARM_PREFIX

pytestmark = pytest.mark.django_db(transaction=True)

STRANGER = "203.0.113.7"  # TEST-NET-3: nobody's node
H = "ab" * 32


def announce(byte_listener: str, node: str, token: str, hashes: list[str], port: int = 6881, **extra):
    return requests.get(
        byte_listener + "announce",
        params=[("info_hash", h) for h in hashes] + [("port", str(port))] + list(extra.items()),
        headers=credentials.bearer(credentials.bytes_pass(signing.token_hash(token), node)),
        timeout=30,
    )


@pytest.fixture
def two_nodes(byte_listener, redis_client):
    """Nodes a and b, enrolled, and a tracker that has heard from nobody (earlier tests' nodes announced too)."""
    for key in redis_client.scan_iter("llmgw:swarm*"):
        redis_client.delete(key)
    return {"a": issue_token("a"), "b": issue_token("b")}


def everything_said(answer: dict) -> set[str]:
    return set(answer["fleet"]) | {p["host"] for peers in answer["peers"].values() for p in peers}


def test_a_host_named_in_an_announce_reaches_no_other_nodes_fleet_or_peers(byte_listener, two_nodes):
    forged = announce(byte_listener, "a", two_nodes["a"], [H], port=7001, host=STRANGER)
    assert forged.status_code == 200, forged.text
    answer = announce(byte_listener, "b", two_nodes["b"], [H], port=7002)
    assert answer.status_code == 200, answer.text
    said = answer.json()
    assert STRANGER not in everything_said(said), said
    # a is still b's peer, at the address its announce came from.
    assert said["peers"][H] == [{"node": "a", "host": "127.0.0.1", "port": 7001}]
    assert said["fleet"] == ["127.0.0.1", "127.0.0.1"]


def test_a_peer_record_written_straight_into_redis_is_believed_by_no_answer(byte_listener, two_nodes, redis_client):
    # Anyone with the Redis password can write here: a record naming enrolled node a at a stranger's address.
    record = json.dumps({"host": STRANGER, "port": 7001, "at": time.time()})
    redis_client.hset(SWARM_FLEET, "a", record)
    redis_client.hset(SWARM_PREFIX + H, "a", record)
    answer = announce(byte_listener, "b", two_nodes["b"], [H], port=7002)
    assert answer.status_code == 200, answer.text
    said = answer.json()
    assert STRANGER not in everything_said(said), said
    assert said["peers"][H] == [] and said["fleet"] == ["127.0.0.1"], said


def swarm_keys_of(redis_client, node: str) -> int:
    return sum(1 for key in redis_client.scan_iter(SWARM_PREFIX + "*", count=1000) if redis_client.hexists(key, node))


def test_an_announce_of_a_thousand_torrents_is_refused_and_a_node_holds_no_more_keys_than_the_cap(
    byte_listener, two_nodes, redis_client
):
    thousand = [f"{i:064x}" for i in range(1000)]
    # A thousand do not fit a request line the byte listener reads; one past the cap fits, and is refused.
    assert announce(byte_listener, "a", two_nodes["a"], thousand).status_code == 400
    refused = announce(byte_listener, "a", two_nodes["a"], thousand[: MAX_INFO_HASHES + 1])
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"] == f"an announce names at most {MAX_INFO_HASHES} torrents, not {MAX_INFO_HASHES + 1}"
    assert swarm_keys_of(redis_client, "a") == 0

    # Announces of 50 torrents each, every one naming others: only the last one's records stay, where
    # each announce used to add its own for 300 s. The cap fits a request line, and is accepted.
    for start in (0, 50, 100, 150):
        answer = announce(byte_listener, "a", two_nodes["a"], thousand[start : start + 50])
        assert answer.status_code == 200, answer.text
    assert swarm_keys_of(redis_client, "a") == 50
    assert redis_client.hexists(SWARM_PREFIX + thousand[150], "a")
    assert not redis_client.hexists(SWARM_PREFIX + thousand[0], "a")
    assert announce(byte_listener, "a", two_nodes["a"], thousand[:MAX_INFO_HASHES]).status_code == 200
    assert swarm_keys_of(redis_client, "a") == MAX_INFO_HASHES


def test_the_agent_names_no_more_torrents_than_the_tracker_takes():
    from agent.peers import ANNOUNCE_MAX_TORRENTS

    assert ANNOUNCE_MAX_TORRENTS == MAX_INFO_HASHES


def test_a_node_announcing_faster_than_its_pace_is_answered_429_and_keeps_its_peers(byte_listener, two_nodes):
    started = time.monotonic()
    statuses = [announce(byte_listener, "a", two_nodes["a"], [H]) for _ in range(3 * ANNOUNCES_PER_WINDOW)]
    windows = int((time.monotonic() - started) // RATE_WINDOW_S) + 1
    codes = [s.status_code for s in statuses]
    assert 429 in codes, codes
    assert codes.count(200) <= ANNOUNCES_PER_WINDOW * windows, codes
    limited = statuses[codes.index(429)]
    assert limited.headers["Retry-After"] == str(RATE_WINDOW_S)
    assert limited.json()["error"].startswith(f"node a announced more than {ANNOUNCES_PER_WINDOW} times")
    # Another node's pace is its own.
    assert announce(byte_listener, "b", two_nodes["b"], [H]).status_code == 200
