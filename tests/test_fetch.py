"""Fetching from a real byte listener, through a loopback proxy that counts what it sent."""

import hashlib
import json
import os
import re
import subprocess
import sys

import pytest

from agent.fetch import FetchError, cache_path, fetch_source, is_set
from agent.progress import Cancelled, Progress

from .support.mirror import listing, put
from .support.processes import BASE_DIR, CountingProxy, as_node, node_env
from .support.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

SIZES = {"model-00001-of-00004.gguf": 300_000, "model-00002-of-00004.gguf": 250_000, "b.json": 1_000, "c.bin": 70_001}


def content(name: str, size: int, salt: bytes = b"") -> bytes:
    seed = hashlib.sha256(name.encode() + salt).digest()
    return (seed * (size // len(seed) + 1))[:size]


@pytest.fixture
def four_files(mirror_root):
    files = {name: content(name, size) for name, size in SIZES.items()}
    put(mirror_root, "m", "v1", files)
    return files


def test_a_four_file_set_is_fetched_whole_into_one_directory(proxy, four_files, cache):
    source = proxy.url + "m/v1/"
    directory = fetch_source(source, cache)
    assert directory == cache_path(source, cache)
    assert listing(directory) == sorted([*four_files, ".complete"])
    for name, data in four_files.items():
        assert (directory / name).read_bytes() == data
    assert (directory / ".complete").read_text() == source + "\n"
    # Each file's bytes once, and the manifest: nothing sent twice.
    # Each byte of each file once (through libtorrent, issue 24: the set's torrent and the tracker's answers besides).
    assert {name: proxy.path_bytes.get(f"/m/v1/{name}", 0) for name in SIZES} == SIZES


def _manifest_bytes(proxy) -> int:
    # The proxy counts every body it relays, the manifest's included.

    return len(as_node.get(proxy.upstream.geturl() + "m/v1/").content)


def test_a_complete_set_is_not_fetched_again_only_its_manifest_is_asked(proxy, four_files, cache):
    fetch_source(proxy.url + "m/v1/", cache)
    proxy.reset_counts()
    fetch_source(proxy.url + "m/v1/", cache)
    # The manifest, to see the set is still the mirror's (issue 21); no file, no torrent (the node's own
    # announces to the tracker, which come when they will, are counted apart: `proxy.announces`).
    assert proxy.requests == [("GET", "/m/v1/", "")]


def test_files_already_there_at_the_right_size_are_not_fetched_again(proxy, four_files, cache):
    directory = fetch_source(proxy.url + "m/v1/", cache)
    (directory / ".complete").unlink()
    (directory / "c.bin").unlink()
    (directory / "b.json").write_bytes(b"short")  # the wrong size: fetched again
    proxy.reset_counts()
    fetch_source(proxy.url + "m/v1/", cache)
    # Files only (the set's torrent and the tracker are asked too), each once (libtorrent asks in ranges).
    fetched = sorted(path.rsplit("/", 1)[-1] for path, sent in proxy.path_bytes.items() if path.startswith("/m/v1/"))
    fetched = [name for name in fetched if name]
    assert fetched == ["b.json", "c.bin"]
    assert proxy.path_bytes["/m/v1/b.json"] == len(four_files["b.json"])
    assert proxy.path_bytes["/m/v1/c.bin"] == len(four_files["c.bin"])
    assert (directory / "b.json").read_bytes() == four_files["b.json"]
    assert (directory / ".complete").exists()


def test_a_truncated_body_keeps_the_part_and_the_next_attempt_sends_only_the_rest(proxy, mirror_root, cache):
    data = content("one", 500_000)
    put(mirror_root, "m", "v1", {"one.gguf": data})
    source = proxy.url + "m/v1/one.gguf"
    proxy.truncate_after = 123_456
    with pytest.raises(FetchError) as failed:
        fetch_source(source, cache)
    assert "stopped after 123,456 bytes" in str(failed.value) or "ended after 123,456" in str(failed.value)
    assert "the part is kept" in str(failed.value)
    assert failed.value.transient  # worth trying again by itself
    target = cache_path(source, cache)
    assert not target.exists()
    assert target.with_name("one.gguf.part").stat().st_size == 123_456

    proxy.truncate_after = None
    proxy.reset_counts()
    assert fetch_source(source, cache).read_bytes() == data
    # The rest of the file, and its version's manifest (its size and sha256, issue 21).
    assert proxy.body_bytes - _manifest_bytes(proxy) == 500_000 - 123_456
    assert ("GET", "/m/v1/one.gguf", "bytes=123456-") in proxy.requests
    assert not target.with_name("one.gguf.part").exists()


def test_a_server_that_ignores_range_makes_the_file_start_over_never_append(proxy, mirror_root, cache):
    data = content("one", 400_000)
    put(mirror_root, "m", "v1", {"one.gguf": data})
    source = proxy.url + "m/v1/one.gguf"
    proxy.truncate_after = 100_000
    with pytest.raises(FetchError):
        fetch_source(source, cache)
    proxy.truncate_after = None
    proxy.ignore_range = True
    proxy.reset_counts()
    assert fetch_source(source, cache).read_bytes() == data
    assert proxy.body_bytes - _manifest_bytes(proxy) == 400_000


def test_a_file_that_changes_on_the_mirror_between_attempts_is_fetched_new_and_whole(proxy, mirror_root, cache):
    put(mirror_root, "m", "v1", {"one.gguf": content("one", 300_000)})
    source = proxy.url + "m/v1/one.gguf"
    proxy.truncate_after = 100_000
    with pytest.raises(FetchError):
        fetch_source(source, cache)
    new = content("one", 300_000, salt=b"retrained")
    (mirror_root / "m" / "v1" / "one.gguf").write_bytes(new)
    os.utime(mirror_root / "m" / "v1" / "one.gguf", (1_900_000_000, 1_900_000_000))
    proxy.truncate_after = None
    proxy.reset_counts()
    # If-Range carries the old file's ETag, so the byte listener answers the new file whole.
    assert fetch_source(source, cache).read_bytes() == new
    assert proxy.body_bytes - _manifest_bytes(proxy) == 300_000


def test_a_set_whose_file_changed_size_between_attempts_is_fetched_new_and_whole(proxy, four_files, mirror_root, cache):
    source = proxy.url + "m/v1/"
    # Stopped partway (libtorrent rides out bodies cut short, which is how this test stopped the HTTP fetch).
    with pytest.raises(FetchError):
        fetch_source(source, cache, StopAfter(50_000), parallel=1)
    new = content("model-00001-of-00004.gguf", 310_000, salt=b"v2")
    (mirror_root / "m" / "v1" / "model-00001-of-00004.gguf").write_bytes(new)
    directory = fetch_source(source, cache)
    assert (directory / "model-00001-of-00004.gguf").read_bytes() == new
    assert (directory / ".complete").exists()


class StopAfter(Progress):
    """Stops the fetch once this many bytes are in, the HTTP fetcher's or libtorrent's."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit

    def advanced(self, nbytes):
        super().advanced(nbytes)
        if self.bytes_done >= self.limit:
            raise Cancelled("stopped partway")

    def swarm(self, status):
        super().swarm(status)
        if self.bytes_done >= self.limit:
            raise Cancelled("stopped partway")


class StopAtTheLastByte(Progress):
    """Stops the fetch after the last byte is written and before the rename, as a crash there would."""

    def advanced(self, nbytes):
        super().advanced(nbytes)
        if self.bytes_total and self.bytes_done >= self.bytes_total:
            raise Cancelled("stopped at the last byte")


def test_a_part_that_is_already_whole_is_renamed_after_the_416(proxy, mirror_root, cache):
    data = content("one", 200_000)
    put(mirror_root, "m", "v1", {"one.gguf": data})
    source = proxy.url + "m/v1/one.gguf"
    with pytest.raises(FetchError):
        fetch_source(source, cache, progress=StopAtTheLastByte())
    target = cache_path(source, cache)
    assert not target.exists()
    assert target.with_name("one.gguf.part").stat().st_size == 200_000
    proxy.reset_counts()
    assert fetch_source(source, cache).read_bytes() == data
    assert ("GET", "/m/v1/one.gguf", "bytes=200000-") in proxy.requests
    assert proxy.body_bytes - _manifest_bytes(proxy) < 200  # the 416's short JSON sentence, and no file bytes


def test_a_file_that_does_not_match_its_sha256_is_removed_and_never_renamed(proxy, four_files, cache):
    manifest = json.loads(_get(proxy.upstream.geturl() + "m/v1/"))
    manifest["files"][0]["sha256"] = "0" * 64
    proxy.overrides["/m/v1/"] = (200, "application/json", json.dumps(manifest).encode())
    with pytest.raises(FetchError) as failed:
        fetch_source(proxy.url + "m/v1/", cache, parallel=1)
    name = manifest["files"][0]["name"]
    assert f"{name} does not match its sha256" in str(failed.value)
    directory = cache_path(proxy.url + "m/v1/", cache)
    assert not (directory / name).exists()
    assert not (directory / (name + ".part")).exists()
    assert not (directory / ".complete").exists()


def _get(url) -> bytes:
    return as_node.get(url, timeout=5).content


@pytest.mark.parametrize(
    "body, content_type, sentence",
    [
        (
            b"<html><body><a href='a.gguf'>a.gguf</a></body></html>",
            "text/html",
            "did not answer with a manifest; a source ending in / has to be a mirror version, not a directory listing",
        ),
        (b'{"model": "m", "version": "v1", "files": [], "bytes": 0}', "application/json", "/m/v1/ holds no files"),
        (b'{"model": "m", "version": "v1"}', "application/json", "did not answer with a manifest"),
        (b"[1, 2]", "application/json", "did not answer with a manifest"),
        (b'{"files": [' + b'{"name": "a", "bytes": 1},' * 50_000 + b"]}", "application/json", "more than 1 MiB"),
    ],
    ids=["html-listing", "no-files", "no-files-key", "not-an-object", "over-1MiB"],
)
def test_a_bad_manifest_is_refused_with_a_sentence(proxy, four_files, cache, body, content_type, sentence):
    proxy.overrides["/m/v1/"] = (200, content_type, body)
    with pytest.raises(FetchError) as failed:
        fetch_source(proxy.url + "m/v1/", cache)
    assert sentence in str(failed.value)
    assert "Expecting" not in str(failed.value) and "line 1" not in str(failed.value)
    assert not failed.value.transient  # trying again would only say the same
    assert not cache_path(proxy.url + "m/v1/", cache).exists()


@pytest.mark.parametrize("name", ["../escape.gguf", "a/b.gguf", "a\\b.gguf", ".", "..", "", "a\x00b", ".complete"])
def test_a_manifest_naming_an_unsafe_file_is_refused_naming_it(proxy, four_files, cache, tmp_path, name):
    manifest = {"model": "m", "version": "v1", "files": [{"name": "ok.gguf", "bytes": 3}, {"name": name, "bytes": 3}]}
    proxy.overrides["/m/v1/"] = (200, "application/json", json.dumps(manifest).encode())
    with pytest.raises(FetchError) as failed:
        fetch_source(proxy.url + "m/v1/", cache)
    assert f"the mirror offered a file named {name!r}" in str(failed.value)
    assert not (tmp_path / "escape.gguf").exists()
    assert not cache_path(proxy.url + "m/v1/", cache).exists()


def test_a_manifest_answered_with_an_error_status_says_so(proxy, four_files, cache):
    with pytest.raises(FetchError) as failed:
        fetch_source(proxy.url + "m/nope/", cache)
    assert str(failed.value) == f"{proxy.url}m/nope/ is not on the mirror (404)"


def test_a_mirror_that_cannot_be_reached_is_a_sentence(cache, settings):
    settings.BYTES_URL = "http://127.0.0.1:9/"
    with pytest.raises(FetchError) as failed:
        fetch_source("http://127.0.0.1:9/m/v1/", cache)
    assert (
        str(failed.value)
        == "asking http://127.0.0.1:9/m/v1/ what it holds: could not connect or the connection was dropped"
    )


def test_too_little_disk_is_refused_up_front_with_both_numbers(proxy, four_files, cache):
    huge = 1 << 60
    manifest = {"model": "m", "version": "v1", "files": [{"name": "big.gguf", "bytes": huge}], "bytes": huge}
    proxy.overrides["/m/v1/"] = (200, "application/json", json.dumps(manifest).encode())
    with pytest.raises(FetchError) as failed:
        fetch_source(proxy.url + "m/v1/", cache)
    sentence = str(failed.value)
    match = re.search(r"needs ([\d,]+) more bytes .* only ([\d,]+) bytes .* are free under", sentence)
    assert match, sentence
    assert int(match.group(1).replace(",", "")) == huge
    assert 0 < int(match.group(2).replace(",", "")) < huge
    assert [r for r in proxy.requests if r[1] != "/m/v1/"] == []


@pytest.mark.parametrize(
    "source",
    [
        "http://mirror:8001/m/%2e%2e/%2e%2e/%2e%2e/etc/",
        "http://mirror:8001/m/..%2f..%2f/x",
        "http://mirror:8001/m/v1/..%5c..%5cx",
        "http://mirror:8001/m/v1/a%00b",
        "http://mirror:8001//etc/passwd",
        "http://mirror:8001/m/v1/.complete",
        "http://mirror:8001/m/v1/x.gguf?../../x",
        "http://mirror:8001/",
        "file:///etc/passwd",
        "/etc/passwd",
    ],
)
def test_no_address_can_make_a_fetch_write_outside_the_cache(source, cache, tmp_path):
    with pytest.raises(FetchError):
        cache_path(source, cache)
    with pytest.raises(FetchError):
        fetch_source(source, cache)
    assert [p for p in tmp_path.rglob("*") if p.is_file() and ".fetch" not in p.parts] == []


def test_the_cache_path_keeps_host_port_and_path(cache):
    assert cache_path("http://Mirror:8001/m/v1/", cache) == cache / "mirror_8001" / "m" / "v1"
    assert cache_path("http://mirror/m/v1/a.gguf", cache) == cache / "mirror_80" / "m" / "v1" / "a.gguf"
    assert is_set("http://mirror/m/v1/") and not is_set("http://mirror/m/v1/a.gguf")


def test_two_processes_fetching_one_set_take_turns_and_each_byte_is_sent_once(byte_listener, four_files, cache):
    proxy = CountingProxy(byte_listener, rate=400_000)  # about 1.5 s for the set
    try:
        source = proxy.url + "m/v1/"
        argv = [sys.executable, "manage.py", "fetch", source, "--cache", str(cache)]
        env = node_env(LLMGW_BYTES_URL=proxy.url)
        first = subprocess.Popen(argv, cwd=BASE_DIR, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        wait_until(lambda: proxy.body_bytes > 50_000, timeout=30, what="the first fetch to be under way")
        second = subprocess.Popen(argv, cwd=BASE_DIR, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out1, err1 = first.communicate(timeout=60)
        out2, err2 = second.communicate(timeout=60)
        assert first.returncode == 0, err1
        assert second.returncode == 0, err2
        directory = cache_path(source, cache)
        for name, data in four_files.items():
            assert (directory / name).read_bytes() == data
        # Each file's bytes sent once, over one fetch or the other (libtorrent asks in ranges).
        assert {name: proxy.path_bytes.get(f"/m/v1/{name}") for name in four_files} == {
            name: len(data) for name, data in four_files.items()
        }
        assert out1.decode().strip() == out2.decode().strip() == str(directory)
    finally:
        proxy.stop()


def test_the_fetch_command_exits_non_zero_with_the_sentence(cache):
    done = subprocess.run(
        [sys.executable, "manage.py", "fetch", "http://127.0.0.1:9/m/v1/", "--cache", str(cache)],
        cwd=BASE_DIR,
        env=node_env(LLMGW_BYTES_URL="http://127.0.0.1:9/"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert "asking http://127.0.0.1:9/m/v1/ what it holds: could not connect" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_single_file_and_its_set_fetched_at_once_share_the_file_and_each_byte_is_sent_once(
    byte_listener, four_files, cache, settings
):
    import threading

    proxy = CountingProxy(byte_listener, rate=300_000)
    settings.BYTES_URL = proxy.url
    try:
        results = {}

        def run(key, source):
            results[key] = fetch_source(source, cache)

        one = threading.Thread(target=run, args=("file", proxy.url + "m/v1/model-00001-of-00004.gguf"))
        whole = threading.Thread(target=run, args=("set", proxy.url + "m/v1/"))
        one.start()
        wait_until(lambda: proxy.body_bytes > 10_000, timeout=30, what="the single file to be under way")
        whole.start()
        one.join(60)
        whole.join(60)
        assert results["file"] == results["set"] / "model-00001-of-00004.gguf"
        for name, data in four_files.items():
            assert (results["set"] / name).read_bytes() == data
        # Each file's bytes sent once (the set through libtorrent asks in ranges, and asks the tracker too).
        assert {name: proxy.path_bytes.get(f"/m/v1/{name}") for name in four_files} == {
            name: len(data) for name, data in four_files.items()
        }
    finally:
        proxy.stop()
