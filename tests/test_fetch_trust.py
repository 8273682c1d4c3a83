"""Issue 13, items 1b, 5 and 6: where a node fetches from, what a file's name means in an
address, and how much of a body it takes. Every server here is on this machine's loopback."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

from agent.fetch import FetchError, cache_path, fetch_source

from .support.mirror import put
from .support.processes import BASE_DIR, node_env, start_byte_listener
from .support.servers import LoopbackServer

pytestmark = pytest.mark.django_db(transaction=True)


def not_found(handler, method):
    handler.send_response(404)
    handler.send_header("Content-Length", "0")
    handler.end_headers()


@pytest.fixture
def elsewhere():
    server = LoopbackServer(not_found)
    yield server
    server.stop()


@pytest.mark.parametrize("path", ["m/v1/", "m/v1/a.gguf"])
def test_a_source_on_another_port_of_this_machine_is_refused_before_any_request(
    settings, byte_listener, elsewhere, cache, path
):
    settings.BYTES_URL = byte_listener
    with pytest.raises(FetchError) as refused:
        fetch_source(elsewhere.url + path, cache)
    assert f"is not on this node's byte listener {byte_listener} (LLMGW_BYTES_URL)" in str(refused.value)
    assert elsewhere.requests == []


def test_a_redirect_from_the_byte_listener_to_another_host_is_not_followed(settings, elsewhere, cache):
    def redirect(handler, method):
        handler.send_response(302)
        handler.send_header("Location", elsewhere.url + "m/v1/")
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    listener = LoopbackServer(redirect)
    settings.BYTES_URL = listener.url
    try:
        with pytest.raises(FetchError) as refused:
            fetch_source(listener.url + "m/v1/", cache)
        assert "another host; it is not followed" in str(refused.value)
        assert elsewhere.requests == []
    finally:
        listener.stop()


def test_the_fetch_command_fetches_from_another_host_only_when_allowed(
    byte_listener, mirror_root, cache, elsewhere, tmp_path
):
    put(mirror_root, "m", "v1", {"a.bin": b"a" * 1000})
    # The other host is a public mirror: a node's pass goes to its own byte listener only.
    other, other_url = start_byte_listener(mirror_root, tmp_path, LLMGW_BYTES_PUBLIC="true")
    try:
        source = other_url + "m/v1/"
        argv = [sys.executable, "manage.py", "fetch", source, "--cache", str(cache), "--quiet"]
        env = node_env(LLMGW_BYTES_URL=elsewhere.url)
        refused = subprocess.run(argv, cwd=BASE_DIR, env=env, capture_output=True, text=True, timeout=60)
        assert refused.returncode == 1 and "is not on this node's byte listener" in refused.stderr
        assert not cache.exists() or not any(cache.rglob("a.bin"))
        allowed = subprocess.run(
            [*argv, "--allow-any-host"], cwd=BASE_DIR, env=env, capture_output=True, text=True, timeout=60
        )
        assert allowed.returncode == 0, allowed.stderr
        assert (cache_path(source, cache) / "a.bin").read_bytes() == b"a" * 1000
    finally:
        other.stop()


# --- 5: every name is encoded into its address -------------------------------------------

NAMES = {
    "r%41.bin": b"percent " * 512,
    "rA.bin": b"capital " * 512,  # what r%41.bin would name if it were not encoded
    "a#b.bin": b"hash....",
    "q?x=1.bin": b"question",
    "with space.bin": b"spaces..",
    "naïve-模型.bin": "ünïcode".encode(),
    "100%.bin": b"hundred.",
}


def test_file_names_with_percent_hash_question_mark_space_and_non_ascii_arrive_with_their_own_bytes(
    settings, byte_listener, mirror_root, cache
):
    settings.BYTES_URL = byte_listener
    put(mirror_root, "odd", "v1", NAMES)
    directory = fetch_source(byte_listener + "odd/v1/", cache)
    for name, data in NAMES.items():
        assert (directory / name).read_bytes() == data, name
    assert (directory / ".complete").exists()


# --- 6: a fetch stops at the size it was promised ------------------------------------------

PROMISED = 4096


def endless(handler, method):
    """A manifest promising 4096 bytes, and a file body (no Content-Length) that never ends."""
    if handler.path.endswith("/"):
        body = json.dumps({"model": "m", "version": "v1", "files": [{"name": "big.bin", "bytes": PROMISED}]}).encode()
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)
        return
    handler.send_response(200)
    if method == "HEAD":
        handler.send_header("Content-Length", str(PROMISED))
        handler.end_headers()
        return
    handler.end_headers()  # HTTP/1.0, no length: the body lasts until the connection closes
    chunk = b"x" * 65536
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        handler.wfile.write(chunk)


@pytest.mark.parametrize("path", ["m/v1/", "m/v1/big.bin"], ids=["a set (the manifest's size)", "one file (HEAD's)"])
def test_a_body_longer_than_promised_is_an_error_and_the_part_never_grows_past_it(settings, cache, path):
    server = LoopbackServer(endless)
    settings.BYTES_URL = server.url
    source = server.url + path
    target = cache_path(server.url + "m/v1/big.bin", cache)
    part = target.with_name("big.bin.part")
    largest = [0]
    done = threading.Event()

    def watch():
        while not done.is_set():
            try:
                largest[0] = max(largest[0], part.stat().st_size)
            except OSError:
                pass
            time.sleep(0.005)  # sampling the part's size while it is written

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    outcome: list = []

    def run():
        try:
            outcome.append(fetch_source(source, cache))
        except FetchError as error:
            outcome.append(error)

    fetching = threading.Thread(target=run, daemon=True)
    fetching.start()
    fetching.join(10)
    done.set()
    server.stop()
    assert outcome, "the fetch went on reading an endless body"
    assert isinstance(outcome[0], FetchError)
    assert f"sent more than the {PROMISED:,} bytes the file has" in str(outcome[0])
    assert largest[0] <= PROMISED
    assert not part.exists() and not target.exists()
