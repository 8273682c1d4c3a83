"""Issue 21, item 5: a version is offered whole or not at all, on the mirror's side too.

A real byte listener, files written into the mirror as `cp` writes them, and nodes
fetching with `manage.py fetch` and `fetch_source`: a file still being written makes
the manifest "not ready" (503, Retry-After, the sentence) and the node waits; every file
of a ready manifest has its sha256; `.complete` is written only when every hash agrees;
a cached set that fails its hashes is fetched again, and one that holds is not hashed.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time

import pytest

from agent import fetch_set as fetch_set_module
from agent.fetch import cache_path, fetch_source
from contracts import keys
from fleet.placement import ModelView, NodeView, ProfileView, place
from mirror import scan
from mirror.bytes_views import _forget_if_changed
from mirror.disk import DiskFile
from mirror.models import MirrorVersion
from mirror.readiness import Readiness, source_being_written
from serving.services import plan_for

from .support.mirror import put
from .support.processes import BASE_DIR, as_node, node_env, start_byte_listener, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

MIB = 1 << 20


def data(name: str, size: int) -> bytes:
    seed = hashlib.sha256(name.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


# --- the manifest ------------------------------------------------------------------------------


def test_a_file_still_being_written_makes_the_manifest_not_ready_with_a_sentence_and_retry_after(
    byte_listener, mirror_root
):
    put(mirror_root, "m", "v1", {"b.bin": b"b" * 100})
    put(mirror_root, "m", "v1", {"a.bin": b"a" * 1000}, settled=False)
    answer = as_node.get(byte_listener + "m/v1/", timeout=5)
    assert answer.status_code == 503
    body = answer.json()
    assert body["ready"] is False
    assert body["error"].startswith("a.bin is still being written (it changed ")
    assert 1 <= int(answer.headers["Retry-After"]) <= 11
    # The rest of the manifest is there, so whoever reads it sees what is coming.
    assert [f["name"] for f in body["files"]] == ["a.bin", "b.bin"]


@pytest.mark.parametrize("change", ["copied in again", "another file added", "rewritten at the same size"])
def test_a_version_changed_on_the_mirror_loses_its_copy_in_redis_so_no_node_is_given_the_old_set(
    byte_listener, mirror_root, redis_client, change
):
    """The copy a ready manifest leaves in Redis is what nodes use when the byte listener is away (issue 38).

    Once the version on disk is not the one it lists, the copy goes with the next "not ready"
    answer: else a node asking during an outage would fetch, from its peers, a set the mirror
    no longer holds (the old code kept it until the version was next served whole).
    """
    put(mirror_root, "m", "v1", {"a.bin": b"a" * 1000})
    key = keys.swarm_version_key("m", "v1")
    assert as_node.get(byte_listener + "m/v1/", timeout=5).status_code == 200
    wait_until(lambda: redis_client.hget(key, "manifest"), timeout=10, what="the manifest's copy in Redis")
    assert b"m/v1" in redis_client.smembers(keys.SWARM_VERSIONS)
    if change == "copied in again":
        put(mirror_root, "m", "v1", {"a.bin": b"b" * 2000}, settled=False)
    elif change == "another file added":
        put(mirror_root, "m", "v1", {"b.bin": b"b" * 10}, settled=False)
    else:
        put(mirror_root, "m", "v1", {"a.bin": b"c" * 1000}, settled=False)
    answer = as_node.get(byte_listener + "m/v1/", timeout=5)
    assert answer.status_code == 503, answer.text
    assert redis_client.exists(key) == 0
    assert b"m/v1" not in redis_client.smembers(keys.SWARM_VERSIONS)


def test_a_version_not_ready_only_for_its_index_keeps_its_copy_in_redis(byte_listener, mirror_root, redis_client):
    """Unchanged files keep their copy: a mirror whose index cannot be read still has nodes fetch from peers."""
    put(mirror_root, "m", "v1", {"a.bin": b"a" * 1000})
    key = keys.swarm_version_key("m", "v1")
    assert as_node.get(byte_listener + "m/v1/", timeout=5).status_code == 200
    wait_until(lambda: redis_client.hget(key, "manifest"), timeout=10, what="the manifest's copy in Redis")
    files = [DiskFile("a.bin", 1000, (time.time_ns() - 60 * 10**9))]
    _forget_if_changed("m", "v1", files, Readiness({}, "the mirror's index cannot be read", 10))
    assert redis_client.hget(key, "manifest")
    _forget_if_changed("m", "v1", [DiskFile("a.bin", 1000, time.time_ns())], Readiness({}, "being written", 1))
    assert redis_client.exists(key) == 0


def test_every_file_of_a_ready_manifest_has_its_sha256_even_before_any_scan(byte_listener, mirror_root):
    files = {"a.bin": data("a", 300_000), "b.json": b"{}"}
    put(mirror_root, "m", "v1", files)
    assert not MirrorVersion.objects.exists()
    answer = as_node.get(byte_listener + "m/v1/", timeout=5)
    assert answer.status_code == 200, answer.text
    assert {f["name"]: f["sha256"] for f in answer.json()["files"]} == {
        name: hashlib.sha256(content).hexdigest() for name, content in files.items()
    }
    assert MirrorVersion.objects.get().state == "complete"  # hashed once, kept in the index


def test_a_version_too_large_to_hash_in_the_request_is_not_ready_until_it_is_hashed(mirror_root, tmp_path, fleet_node):
    put(mirror_root, "m", "v1", {"a.bin": data("a", 2 * MIB), "b.bin": data("b", MIB)})
    process, url = start_byte_listener(mirror_root, tmp_path, LLMGW_MIRROR_HASH_INLINE_BYTES=1000)
    try:
        first = as_node.get(url + "m/v1/", timeout=5)
        if first.status_code == 503:  # the background hash may already be done on a fast disk
            assert "the mirror is still hashing" in first.json()["error"]
            assert "a version is served only with a sha256 for every file" in first.json()["error"]
            assert int(first.headers["Retry-After"]) >= 1
        ready = wait_until(
            lambda: (r := as_node.get(url + "m/v1/", timeout=5)).status_code == 200 and r,
            timeout=30,
            what="the byte listener to finish hashing in the background",
        )
        assert [f["sha256"] for f in ready.json()["files"]] == [
            hashlib.sha256(data("a", 2 * MIB)).hexdigest(),
            hashlib.sha256(data("b", MIB)).hexdigest(),
        ]
    finally:
        process.stop()


# --- the serve page and placement ----------------------------------------------------------------


def test_the_serve_page_and_placement_do_not_offer_a_version_still_being_written(mirror_root, settings):
    put(mirror_root, "m", "v1", {"a.gguf": b"g" * 1000}, settled=False)
    scan.scan_mirror()
    plan = plan_for(MirrorVersion.objects.get())
    assert plan.refusal.startswith("this version is not ready yet: a.gguf is still being written")

    source = settings.BYTES_URL + "m/v1/a.gguf"
    why = source_being_written(source, settings.BYTES_URL)
    assert why.startswith("the mirror's m/v1/ is not ready: a.gguf is still being written")
    node = NodeView(name="n1", engines=frozenset({"llamacpp"}), memory_gb=64)
    profile = ProfileView(name="cpu", engine="llamacpp", min_memory_gb=1)
    placed = place([node], [ModelView("m", source, 1, (profile,), not_ready=why)], [])
    assert placed.assign == [] and [u.reason for u in placed.unplaced] == [why]

    # Settled (the copy ended a while ago): offered, and placed.
    os.utime(mirror_root / "m" / "v1" / "a.gguf", (time.time() - 60, time.time() - 60))
    scan.scan_mirror()
    assert plan_for(MirrorVersion.objects.get()).refusal == ""
    assert source_being_written(source, settings.BYTES_URL) == ""
    assert len(place([node], [ModelView("m", source, 1, (profile,))], []).assign) == 1


# --- a node fetching while the file is written ---------------------------------------------------


def test_a_file_appended_while_a_node_fetches_never_ends_in_a_complete_set_and_the_node_gets_it_whole(
    byte_listener, mirror_root, tmp_path
):
    """The issue's own reproduction: `a.bin` appended a MiB at a time (as `cp` writes), a
    `manage.py fetch` of `m/v1/` started when a third is written. The old code exited 0 with
    `.complete` over a third of the file."""
    size_mib = 24
    final = data("a.bin", size_mib * MIB)
    directory = put(mirror_root, "m", "v1", {"b.bin": b"b" * 1000})
    a_bin = directory / "a.bin"
    third = threading.Event()

    def copy_in():
        with open(a_bin, "wb") as out:
            for i in range(size_mib):
                out.write(final[i * MIB : (i + 1) * MIB])
                out.flush()
                if i == size_mib // 3:
                    third.set()
                time.sleep(0.3)

    writer = threading.Thread(target=copy_in, daemon=True)
    writer.start()
    assert third.wait(30)
    cache = tmp_path / "cache"
    source = byte_listener + "m/v1/"
    fetch = subprocess.Popen(
        [sys.executable, "manage.py", "fetch", source, "--cache", str(cache)],
        cwd=BASE_DIR,
        env=node_env(LLMGW_BYTES_URL=byte_listener),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    marker = cache_path(source, cache) / ".complete"
    try:
        while writer.is_alive():
            assert not marker.exists(), "a set was marked whole while one of its files was still being written"
            time.sleep(0.02)
        out, err = fetch.communicate(timeout=120)
    finally:
        if fetch.poll() is None:
            fetch.kill()
    assert fetch.returncode == 0, err
    assert "is still being written" in err  # it said why it waited
    assert (cache_path(source, cache) / "a.bin").read_bytes() == final
    assert marker.exists()


def test_one_file_fetched_while_it_is_written_waits_and_arrives_whole(byte_listener, mirror_root, tmp_path, settings):
    """A one-file version is served as the file's own address: checked against its version's manifest too."""
    settings.BYTES_URL = byte_listener
    final = data("one.gguf", 8 * MIB)
    directory = put(mirror_root, "m", "v1", {})
    started = threading.Event()

    def copy_in():
        with open(directory / "one.gguf", "wb") as out:
            for i in range(8):
                out.write(final[i * MIB : (i + 1) * MIB])
                out.flush()
                started.set()
                time.sleep(0.3)

    writer = threading.Thread(target=copy_in, daemon=True)
    writer.start()
    assert started.wait(10)
    target = fetch_source(byte_listener + "m/v1/one.gguf", tmp_path / "cache")
    assert not writer.is_alive()  # it waited for the copy to end
    assert target.read_bytes() == final


# --- what a node holds --------------------------------------------------------------------------


def test_a_cached_set_cut_short_by_an_older_fetch_is_fetched_again_and_a_whole_one_is_not_hashed_again(
    proxy, mirror_root, tmp_path, monkeypatch, settings
):
    # The HTTP fetcher's check of a cached set, request by request (docs/agent.md): the torrent path asks
    # for the torrent and the tracker too, and trusts its own resume record of the pieces it verified.
    settings.FETCH_TORRENT = False
    files = {"a.bin": data("a", 400_000), "b.bin": data("b", 100_000)}
    put(mirror_root, "m", "v1", files)
    source = proxy.url + "m/v1/"
    cache = tmp_path / "cache"
    directory = fetch_source(source, cache)
    # What an older fetch left: a.bin cut short, the set marked whole, nothing recorded of its hashes.
    with open(directory / "a.bin", "r+b") as fh:
        fh.truncate(150_000)
    for record in (cache / ".fetch").glob("*.verified.json"):
        record.unlink()
    proxy.reset_counts()
    fetch_source(source, cache)
    assert (directory / "a.bin").read_bytes() == files["a.bin"]
    assert sorted(p for _, p, _ in proxy.requests if not p.endswith("/")) == ["/m/v1/a.bin"]

    # Whole, and checked: the next use asks for the manifest alone and hashes nothing.
    hashed = []
    real = fetch_set_module.sha256_file
    monkeypatch.setattr(fetch_set_module, "sha256_file", lambda p: hashed.append(p) or real(p))
    proxy.reset_counts()
    fetch_source(source, cache)
    assert proxy.requests == [("GET", "/m/v1/", "")] and hashed == []


def test_through_libtorrent_a_cached_set_cut_short_after_it_was_marked_whole_is_made_whole_in_one_fetch(
    proxy, mirror_root, tmp_path
):
    # libtorrent's resume record says every piece of a.bin was verified; the file on disk has lost
    # the end of them. One fetch must see it, fetch those pieces again and keep the rest.
    files = {"a.bin": data("a", 9 * MIB + 1000), "b.bin": data("b", MIB)}
    put(mirror_root, "m", "v1", files)
    source = proxy.url + "m/v1/"
    cache = tmp_path / "cache"
    directory = fetch_source(source, cache)
    assert (directory / ".complete").exists()
    with open(directory / "a.bin", "r+b") as fh:
        fh.truncate(5 * MIB)  # a.bin's first 4 MiB piece whole, its second cut, its third gone
    proxy.reset_counts()
    fetch_source(source, cache)  # one attempt: a failed sha256 check and a second attempt would raise here
    assert (directory / "a.bin").read_bytes() == files["a.bin"] and (directory / ".complete").exists()
    # What was fetched again: the two pieces the file lost, not the piece it kept, and nothing of b.bin.
    assert proxy.path_bytes.get("/m/v1/a.bin") == len(files["a.bin"]) - 4 * MIB, proxy.requests
    assert "/m/v1/b.bin" not in proxy.path_bytes, proxy.requests


def test_a_cached_set_the_mirror_has_changed_since_is_fetched_again_where_it_changed(
    proxy, mirror_root, tmp_path, settings
):
    """A copy that paused longer than the settle time, was served, and went on: the node's set
    was whole for the manifest it had; the manifest it gets next says otherwise."""
    settings.FETCH_TORRENT = False  # counted request by request, as the HTTP fetcher asks
    put(mirror_root, "m", "v1", {"a.bin": data("a", 200_000), "b.bin": b"b" * 10})
    source = proxy.url + "m/v1/"
    cache = tmp_path / "cache"
    directory = fetch_source(source, cache)
    longer = data("a", 300_000)
    put(mirror_root, "m", "v1", {"a.bin": longer})
    proxy.reset_counts()
    fetch_source(source, cache)
    assert (directory / "a.bin").read_bytes() == longer
    assert sorted(p for _, p, _ in proxy.requests if not p.endswith("/")) == ["/m/v1/a.bin"]


def test_a_manifest_without_a_sha256_never_makes_a_complete_set(proxy, mirror_root, tmp_path):
    put(mirror_root, "m", "v1", {"a.bin": b"a" * 1000})
    proxy.overrides["/m/v1/"] = (
        200,
        "application/json",
        b'{"model": "m", "version": "v1", "files": [{"name": "a.bin", "bytes": 1000}], "bytes": 1000}',
    )
    from agent.fetch import FetchError

    with pytest.raises(FetchError) as failed:
        fetch_source(proxy.url + "m/v1/", tmp_path / "cache")
    assert "the mirror gives no sha256 for a.bin" in str(failed.value) and failed.value.transient
    assert not (cache_path(proxy.url + "m/v1/", tmp_path / "cache") / ".complete").exists()
