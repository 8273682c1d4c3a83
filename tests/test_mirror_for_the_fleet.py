"""The mirror answers only the fleet: the byte listener asks every request for a node's pass.

A real byte listener (gunicorn) on the test database, nodes enrolled on the control
plane, and fetches made the way a node makes them: a stranger gets 401 and a
sentence, an enrolled node fetches, a revoked node is refused at its next request
once the byte listener's cache of token hashes has let go (LLMGW_BYTES_PASS_CACHE_S), and the operator can open the mirror with LLMGW_BYTES_PUBLIC=true.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import requests

from agent.fetch import FetchError, cache_path, fetch_source
from agent.fetch_state import read_verified
from agent.progress import Progress
from contracts import credentials, signing
from fleet.enrolment import issue_token, revoke_token

from .support.fleet import live, send_fetch
from .support.mirror import put
from .support.processes import (
    BASE_DIR,
    CountingProxy,
    NoAuth,
    as_node,
    node_env,
    process_env,
    start_agent,
    start_byte_listener,
)
from .support.servers import LoopbackServer
from .support.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

WEIGHTS = bytes(range(256)) * 400  # 102,400 bytes


@pytest.fixture
def two_files(mirror_root):
    return put(mirror_root, "m", "v1", {"a.bin": WEIGHTS, "b.bin": WEIGHTS[::-1]})


def refusal(response: requests.Response) -> str:
    assert response.status_code == 401, response.text
    assert response.headers["Content-Type"] == "application/json"
    assert response.headers["WWW-Authenticate"].startswith("Bearer")
    return response.json()["error"]


# --- strangers and nodes ----------------------------------------------------------------------


def test_an_anonymous_read_of_a_mirror_file_gets_401_and_a_sentence(byte_listener, two_files):
    for method, path in (("GET", "m/v1/a.bin"), ("HEAD", "m/v1/a.bin"), ("GET", "m/v1/"), ("GET", ""), ("GET", "m/")):
        response = requests.request(method, byte_listener + path, auth=NoAuth(), timeout=5)
        assert response.status_code == 401, (method, path)
        assert b"\x00\x01\x02" not in response.content
    sentence = refusal(requests.get(byte_listener + "m/v1/a.bin", auth=NoAuth(), timeout=5))
    assert sentence.startswith("the byte listener serves only the fleet's nodes")
    assert "LLMGW_BYTES_PUBLIC=true" in sentence
    # And a path that exists nowhere says the same: a stranger learns nothing of what is there.
    assert refusal(requests.get(byte_listener + "nope/", auth=NoAuth(), timeout=5)) == sentence


def test_an_enrolled_node_reads_with_its_pass_and_a_wrong_one_is_refused(byte_listener, two_files, fleet_node):
    name, token = fleet_node
    assert as_node.get(byte_listener + "m/v1/a.bin", timeout=5).content == WEIGHTS
    ranged = as_node.get(byte_listener + "m/v1/a.bin", headers={"Range": "bytes=10-19"}, timeout=5)
    assert ranged.status_code == 206 and ranged.content == WEIGHTS[10:20]

    def with_pass(presented: str) -> requests.Response:
        return requests.get(byte_listener + "m/v1/a.bin", headers=credentials.bearer(presented), timeout=5)

    key = signing.token_hash(token)
    assert "not one of node" in refusal(with_pass(credentials.bytes_pass(signing.token_hash("a guess"), name)))
    # Another node's name on this node's MAC: the MAC covers the name.
    issue_token("other")
    forged = credentials.bytes_pass(key, name).replace(f"{name}:", "other:", 1)
    assert "not one of node other's" in refusal(with_pass(forged))
    assert "expired" in refusal(with_pass(credentials.bytes_pass(key, name, now=time.time() - 2 * 3600)))
    assert "not a node's pass" in refusal(with_pass(token))  # the raw token is not a pass, and is never sent
    assert "not one of node ghost's" in refusal(with_pass(credentials.bytes_pass(key, "ghost")))


def test_a_public_mirror_serves_anyone(mirror_root, two_files, tmp_path, django_db_setup):
    process, url = start_byte_listener(mirror_root, tmp_path, LLMGW_BYTES_PUBLIC="true")
    try:
        assert requests.get(url + "m/v1/a.bin", auth=NoAuth(), timeout=5).content == WEIGHTS
        assert [f["name"] for f in requests.get(url + "m/v1/", auth=NoAuth(), timeout=5).json()["files"]] == [
            "a.bin",
            "b.bin",
        ]
    finally:
        process.stop()


def test_a_public_mirror_serves_a_revoked_node_its_set_through_libtorrent_though_the_tracker_refuses_it(
    mirror_root, two_files, tmp_path, settings, monkeypatch
):
    process, url = start_byte_listener(mirror_root, tmp_path, LLMGW_BYTES_PUBLIC="true")
    token = issue_token("gone")
    revoke_token("gone")
    monkeypatch.setenv("LLMGW_NODE_NAME", "gone")
    monkeypatch.setenv("LLMGW_NODE_TOKEN", token)
    settings.BYTES_URL = url
    try:
        # The tracker answers nodes only; the mirror, open to anyone, is the web seed all the same.
        assert requests.get(url + "announce?info_hash=" + "0" * 64 + "&port=1", timeout=5).status_code == 401
        directory = fetch_source(url + "m/v1/", tmp_path / "cache")
    finally:
        process.stop()
    assert (directory / "a.bin").read_bytes() == WEIGHTS and (directory / ".complete").exists()


def test_a_node_fetches_a_set_with_its_pass_and_never_sends_it_to_another_host(
    byte_listener, two_files, settings, tmp_path
):
    settings.BYTES_URL = byte_listener
    directory = fetch_source(byte_listener + "m/v1/", tmp_path / "cache")
    assert (directory / "a.bin").read_bytes() == WEIGHTS and (directory / ".complete").exists()

    seen = []

    def answer(handler, method):
        seen.append(handler.headers.get("Authorization"))
        handler.send_response(200)
        handler.send_header("Content-Length", "3")
        handler.end_headers()
        if method == "GET":
            handler.wfile.write(b"abc")

    elsewhere = LoopbackServer(answer)
    try:
        fetch_source(elsewhere.url + "x/y/z.bin", tmp_path / "cache", any_host=True)
    finally:
        elsewhere.stop()
    assert seen and seen == [None] * len(seen)


# --- revoked ---------------------------------------------------------------------------------


def revoke_and_wait(node: str, byte_listener: str, token: str | None = None) -> bool:
    """Revoke the node's token, and wait until the byte listener refuses its pass: within LLMGW_BYTES_PASS_CACHE_S,
    how long a byte-listener process believes a token hash it has read (docs/mirror.md)."""
    token = token or os.environ["LLMGW_NODE_TOKEN"]
    revoked = revoke_token(node)
    presented = credentials.bearer(credentials.bytes_pass(signing.token_hash(token), node))
    wait_until(
        lambda: requests.get(byte_listener, headers=presented, timeout=5).status_code == 401,
        timeout=30,
        what="the byte listener to refuse the revoked node",
    )
    return revoked


class RevokesOnFirstByte(Progress):
    """Revokes the node's token as the first bytes arrive: the fetch is under way."""

    def __init__(self, node: str, byte_listener: str):
        super().__init__()
        self.node = node
        self.byte_listener = byte_listener
        self.revoked = False

    def advanced(self, nbytes: int) -> None:
        if not self.revoked:
            self.revoked = revoke_and_wait(self.node, self.byte_listener)
        super().advanced(nbytes)


def test_a_node_revoked_mid_fetch_is_refused_at_its_next_range_request_and_nothing_half_is_whole(
    byte_listener, mirror_root, settings, tmp_path, fleet_node
):
    name, _ = fleet_node
    # The HTTP fetcher's own resume (a .part and a Range request), as a source without a torrent is fetched:
    # through libtorrent the whole of this small set comes in the first web-seed answers.
    settings.FETCH_TORRENT = False
    a, b = WEIGHTS * 3, WEIGHTS[::-1] * 3
    put(mirror_root, "m", "v2", {"a.bin": a, "b.bin": b})
    proxy = CountingProxy(byte_listener)
    settings.BYTES_URL = proxy.url
    source = proxy.url + "m/v2/"
    cache = tmp_path / "cache"
    try:
        # An earlier attempt cut short left a part of b.bin, to be resumed with Range.
        proxy.truncate_after = 100_000
        with pytest.raises(FetchError):
            fetch_source(source + "b.bin", cache)
        directory = cache_path(source, cache)
        assert (directory / "b.bin.part").stat().st_size == 100_000
        proxy.truncate_after = None
        proxy.reset_counts()

        progress = RevokesOnFirstByte(name, byte_listener)
        with pytest.raises(FetchError) as failed:
            fetch_source(source, cache, progress=progress, parallel=1)
        assert progress.revoked
        sentence = str(failed.value)
        assert sentence.startswith(f"the byte listener refused {source}b.bin (401): the credential is not one of node")
        assert "revoked" in sentence
        assert not failed.value.transient  # a revoked node stays refused: not tried again by itself
        assert progress.state == "failed" and progress.error == sentence
        # The request refused was the range request resuming b.bin, the next one after the revocation.
        assert proxy.requests[-1] == ("GET", "/m/v2/b.bin", "bytes=100000-")
        # a.bin's answer had begun before the revocation and finished; b.bin stays a part, the set unfinished.
        assert (directory / "a.bin").read_bytes() == a
        assert not (directory / "b.bin").exists() and (directory / "b.bin.part").stat().st_size == 100_000
        assert not (directory / ".complete").exists()
    finally:
        proxy.stop()


class RevokesOnFirstPiece(Progress):
    """Revokes the node's token once libtorrent has verified a piece: the fetch is under way."""

    def __init__(self, node: str, byte_listener: str):
        super().__init__()
        self.node = node
        self.byte_listener = byte_listener
        self.revoked_at: int | None = None  # bytes done when the token was revoked

    def swarm(self, status: dict) -> None:
        if self.revoked_at is None and status["pieces_done"] > 0:
            revoke_and_wait(self.node, self.byte_listener)
            self.revoked_at = status["bytes_done"]
        super().swarm(status)


def test_through_libtorrent_a_node_revoked_mid_fetch_stops_says_why_and_nothing_half_is_whole(
    byte_listener, mirror_root, tmp_path, fleet_node, settings, monkeypatch
):
    name, _ = fleet_node
    mib = 1 << 20
    a, b = (WEIGHTS * 41)[: 6 * mib], (WEIGHTS[::-1] * 41)[: 6 * mib]
    put(mirror_root, "m", "v4", {"a.bin": a, "b.bin": b})
    # Slow enough (libtorrent asks a web seed for a whole file's range at once) that the
    # revocation lands with most of the set still to come.
    proxy = CountingProxy(byte_listener, rate=mib)
    settings.BYTES_URL = proxy.url
    source = proxy.url + "m/v4/"
    cache = tmp_path / "cache"
    try:
        progress = RevokesOnFirstPiece(name, byte_listener)
        with pytest.raises(FetchError) as failed:
            fetch_source(source, cache, progress=progress)
        assert progress.revoked_at is not None, "the fetch ended before a piece was verified"
        sentence = str(failed.value)
        # The byte listener's sentence, as over HTTP, once the tracker has refused the node (its next announce).
        assert sentence.startswith(f"fetching {source}: the byte listener refused {source} (401): the credential is")
        assert "revoked" in sentence, sentence
        assert not failed.value.transient  # a revoked node stays refused: not tried again by itself
        assert progress.state == "failed" and progress.error == sentence
        sent = sum(proxy.path_bytes.get(f"/m/v4/{n}", 0) for n in ("a.bin", "b.bin"))
        assert sent < len(a) + len(b), "the whole set arrived before the revocation took effect"
        directory = cache_path(source, cache)
        assert not (directory / ".complete").exists()
        # Nothing half-written counts as whole: only a file that is the mirror's is recorded as verified.
        for recorded in read_verified(cache, directory):
            assert (directory / recorded).read_bytes() == {"a.bin": a, "b.bin": b}[recorded], recorded
        # Enrolled again, the node gets the set whole, what libtorrent had verified kept.
        monkeypatch.setenv("LLMGW_NODE_TOKEN", issue_token(name))
        proxy.rate = None
        proxy.reset_counts()
        fetch_source(source, cache)
        assert (directory / "a.bin").read_bytes() == a and (directory / "b.bin").read_bytes() == b
        assert (directory / ".complete").exists()
        again = sum(proxy.path_bytes.get(f"/m/v4/{n}", 0) for n in ("a.bin", "b.bin"))
        assert again <= len(a) + len(b) - 4 * mib, again
    finally:
        proxy.stop()


def test_a_real_agent_whose_token_is_revoked_while_it_waits_to_resume_ends_its_fetch_failed_with_the_sentence(
    enrolled_node, control_worker, byte_listener, mirror_root, tmp_path, redis_client
):
    name, token = enrolled_node
    put(mirror_root, "m", "v3", {"a.bin": WEIGHTS * 4})
    proxy = CountingProxy(byte_listener)
    proxy.truncate_after = 150_000
    # Every resume is held at the proxy until the revocation has taken effect: the retry's delay is a
    # second or less, and a resume that ran before it could finish the file (CI, 2026-12-04).
    proxy.hold = lambda who, path, byte_range: path == "/m/v3/a.bin" and bool(byte_range)
    source = proxy.url + "m/v3/"
    cache = tmp_path / "agent-cache"
    # The HTTP fetcher's retry of a cut-short body (libtorrent rides one out without a retry).
    agent = start_agent(name, token, cache, tmp_path, LLMGW_BYTES_URL=proxy.url, LLMGW_FETCH_TORRENT="false")
    try:
        send_fetch(name, source)
        wait_until(lambda: "trying again in" in agent.output(), timeout=30, what="a retry to be scheduled")
        revoke_and_wait(name, byte_listener, token)
        proxy.truncate_after = None
        proxy.hold = None
        snapshot = wait_until(
            lambda: (s := live(redis_client, source, name)).get("state") == "failed" and s,
            timeout=60,
            what=f"the fetch to end failed\n{agent.output()[-2000:]}",
        )
        assert "(401)" in snapshot["error"] and "revoked" in snapshot["error"], snapshot
        directory = cache_path(source, cache)
        assert not (directory / "a.bin").exists() and not (directory / ".complete").exists()
        # Said as the end of the fetch, not as one more retry.
        wait_until(
            lambda: f"fetch of {source} failed: the byte listener refused" in agent.output(),
            what=lambda: f"the agent to say the fetch ended:\n{agent.output()[-2000:]}",
        )
    finally:
        agent.stop()
        proxy.stop()


# --- manage.py fetch --------------------------------------------------------------------------


def test_the_fetch_command_takes_the_nodes_pass_from_the_environment(byte_listener, two_files, tmp_path, fleet_node):
    name, token = fleet_node
    argv = [sys.executable, "manage.py", "fetch", byte_listener + "m/v1/a.bin", "--cache", str(tmp_path), "--quiet"]
    env = node_env(LLMGW_BYTES_URL=byte_listener, LLMGW_NODE_NAME=name, LLMGW_NODE_TOKEN=token)
    done = subprocess.run(argv, cwd=BASE_DIR, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert open(done.stdout.strip(), "rb").read() == WEIGHTS

    for unset in ("LLMGW_NODE_NAME", "LLMGW_NODE_TOKEN"):
        without = {k: v for k, v in env.items() if k != unset}
        argv[5] = str(tmp_path / f"without-{unset}")
        refused = subprocess.run(argv, cwd=BASE_DIR, env=without, capture_output=True, text=True, timeout=60)
        assert refused.returncode == 1
        assert "(401)" in refused.stderr and "LLMGW_NODE_NAME or LLMGW_NODE_TOKEN is not set" in refused.stderr
        assert "Traceback" not in refused.stderr


def test_node_token_revoke_turns_the_pass_off(byte_listener, two_files, fleet_node):
    name, _ = fleet_node
    assert as_node.get(byte_listener + "m/v1/a.bin", timeout=5).status_code == 200
    done = subprocess.run(
        [sys.executable, "manage.py", "node_token", name, "--revoke"],
        cwd=BASE_DIR,
        env=process_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    # Within LLMGW_BYTES_PASS_CACHE_S: how long the byte listener believes a token hash it has read.
    refused = wait_until(
        lambda: (r := as_node.get(byte_listener + "m/v1/a.bin", timeout=5)).status_code == 401 and [r],
        timeout=30,
        what="the byte listener to refuse the revoked node",
    )
    assert "revoked" in refusal(refused[0])
