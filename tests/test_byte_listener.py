"""The byte listener, as a node sees it: a real gunicorn process on a free port."""

import os
import socket
from urllib.parse import urlparse

import pytest
import requests

from .support.mirror import put
from .support.processes import as_node, node_pass

pytestmark = pytest.mark.django_db(transaction=True)

CONTENT = bytes(range(256)) * 40  # 10,240 bytes, every offset distinguishable


@pytest.fixture
def mirror_version(mirror_root):
    put(mirror_root, "m", "v1", {"model.gguf": CONTENT, "b.bin": b"x" * 10})
    return mirror_root / "m" / "v1"


def raw_get(base: str, raw_path: str) -> tuple[int, bytes]:
    """Send a path exactly as written, without a client normalising its dots away."""
    url = urlparse(base)
    authorization = node_pass()(requests.Request("GET", base).prepare()).headers["Authorization"]
    with socket.create_connection((url.hostname, url.port), timeout=5) as s:
        head = f"GET {raw_path} HTTP/1.1\r\nHost: x\r\nAuthorization: {authorization}\r\nConnection: close\r\n\r\n"
        s.sendall(head.encode("latin-1"))
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body


def test_a_whole_file_is_served_with_its_validators(byte_listener, mirror_version):
    r = as_node.get(byte_listener + "m/v1/model.gguf")
    assert r.status_code == 200
    assert r.content == CONTENT
    assert r.headers["Content-Length"] == str(len(CONTENT))
    assert r.headers["Accept-Ranges"] == "bytes"
    assert r.headers["ETag"].startswith('"')
    assert r.headers["Last-Modified"].endswith("GMT")


def test_head_gives_the_headers_and_no_body(byte_listener, mirror_version):
    r = as_node.head(byte_listener + "m/v1/model.gguf")
    assert r.status_code == 200
    assert r.headers["Content-Length"] == str(len(CONTENT))
    assert r.content == b""


@pytest.mark.parametrize(
    "header, start, end",
    [
        ("bytes=100-199", 100, 199),
        ("bytes=10000-", 10000, 10239),
        ("bytes=-40", 10200, 10239),
        ("bytes=10200-99999", 10200, 10239),
    ],
)
def test_a_single_range_is_answered_206_with_exactly_those_bytes(byte_listener, mirror_version, header, start, end):
    r = as_node.get(byte_listener + "m/v1/model.gguf", headers={"Range": header})
    assert r.status_code == 206
    assert r.content == CONTENT[start : end + 1]
    assert r.headers["Content-Range"] == f"bytes {start}-{end}/{len(CONTENT)}"
    assert r.headers["Content-Length"] == str(end - start + 1)


def test_a_range_past_the_end_is_416_with_the_size(byte_listener, mirror_version):
    r = as_node.get(byte_listener + "m/v1/model.gguf", headers={"Range": "bytes=20000-"})
    assert r.status_code == 416
    assert r.headers["Content-Range"] == f"bytes */{len(CONTENT)}"
    assert "outside" in r.json()["error"]


def test_if_range_with_the_current_etag_gets_the_range(byte_listener, mirror_version):
    etag = as_node.head(byte_listener + "m/v1/model.gguf").headers["ETag"]
    r = as_node.get(byte_listener + "m/v1/model.gguf", headers={"Range": "bytes=5-9", "If-Range": etag})
    assert r.status_code == 206
    assert r.content == CONTENT[5:10]


def test_if_range_with_a_stale_validator_gets_the_whole_new_file(byte_listener, mirror_version):
    head = as_node.head(byte_listener + "m/v1/model.gguf").headers
    (mirror_version / "model.gguf").write_bytes(b"new content, longer than before" * 10)
    os.utime(mirror_version / "model.gguf", (1_900_000_000, 1_900_000_000))
    for validator in (head["ETag"], head["Last-Modified"]):
        r = as_node.get(byte_listener + "m/v1/model.gguf", headers={"Range": "bytes=5-9", "If-Range": validator})
        assert r.status_code == 200
        assert r.content == b"new content, longer than before" * 10


def test_a_client_with_the_current_file_is_told_it_has_not_changed(byte_listener, mirror_version):
    url = byte_listener + "m/v1/model.gguf"
    head = as_node.head(url).headers
    for validator in ({"If-None-Match": head["ETag"]}, {"If-Modified-Since": head["Last-Modified"]}):
        r = as_node.get(url, headers=validator)
        assert (r.status_code, r.content, r.headers["ETag"]) == (304, b"", head["ETag"]), validator
    assert as_node.get(url, headers={"If-None-Match": '"other"'}).status_code == 200
    # A write meant for another version of the file is refused rather than answered with this one.
    assert as_node.get(url, headers={"If-Match": '"other"'}).status_code == 412


def test_the_manifest_follows_a_hand_copy_at_once(byte_listener, mirror_version):
    before = as_node.get(byte_listener + "m/v1/").json()
    assert [f["name"] for f in before["files"]] == ["b.bin", "model.gguf"]
    (mirror_version / "c.safetensors").write_bytes(b"123")
    after = as_node.get(byte_listener + "m/v1/").json()
    assert after["model"] == "m" and after["version"] == "v1"
    assert {f["name"]: f["bytes"] for f in after["files"]} == {
        "b.bin": 10,
        "model.gguf": len(CONTENT),
        "c.safetensors": 3,
    }
    assert after["bytes"] == 10 + len(CONTENT) + 3


def test_unfinished_and_hidden_files_are_not_part_of_a_version(byte_listener, mirror_version):
    (mirror_version / "model-2.gguf.part").write_bytes(b"half")
    (mirror_version / ".DS_Store").write_bytes(b"junk")
    names = [f["name"] for f in as_node.get(byte_listener + "m/v1/").json()["files"]]
    assert names == ["b.bin", "model.gguf"]
    assert as_node.get(byte_listener + "m/v1/model-2.gguf.part").status_code == 404
    assert as_node.get(byte_listener + "m/v1/.DS_Store").status_code == 404


def test_the_manifest_carries_a_hash_only_while_it_matches_the_file(byte_listener, mirror_version):
    from mirror import scan
    from mirror.models import MirrorFile

    report = scan.scan_mirror()
    for file_id in report.to_hash:
        scan.hash_file(file_id)
    files = {f["name"]: f for f in as_node.get(byte_listener + "m/v1/").json()["files"]}
    assert files["model.gguf"]["sha256"] == MirrorFile.objects.get(name="model.gguf").sha256
    (mirror_version / "model.gguf").write_bytes(b"changed")
    files = {f["name"]: f for f in as_node.get(byte_listener + "m/v1/").json()["files"]}
    assert "sha256" not in files["model.gguf"]
    assert "sha256" in files["b.bin"]


def test_listings_name_models_and_versions(byte_listener, mirror_version, mirror_root):
    put(mirror_root, "m", "v2", {"x.gguf": b"1"})
    models = as_node.get(byte_listener).json()["models"]
    assert [m["name"] for m in models] == ["m"]
    versions = as_node.get(byte_listener + "m/").json()
    assert [v["version"] for v in versions["versions"]] == ["v1", "v2"]
    assert versions["versions"][0]["url"].endswith("/m/v1/")


@pytest.mark.parametrize(
    "raw_path",
    [
        "/m/v1/../../../etc/passwd",
        "/m/v1/..%2f..%2f..%2fetc%2fpasswd",
        "/m/v1/%2e%2e/%2e%2e/%2e%2e/etc/passwd",
        "/m/v1/..%5c..%5cetc%5cpasswd",
        "/m/v1/model.gguf%00.txt",
        "/m/%2e%2e/",
        "/%2e%2e/%2e%2e/etc/",
        "//etc/passwd",
        "/m/v1/%2fetc%2fpasswd",
        "/m/v1/%252e%252e%252fetc",
        "/m/v1/missing.gguf",
        "/nope/",
    ],
)
def test_no_path_reaches_outside_the_root(byte_listener, mirror_version, raw_path):
    status, body = raw_get(byte_listener, raw_path)
    assert status in (404, 400)
    assert b"root:" not in body
    if status == 404:
        assert b'"error"' in body


def test_a_symlink_out_of_the_root_is_refused(byte_listener, mirror_version, mirror_root, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"do not serve me")
    (mirror_version / "escape.gguf").symlink_to(secret)
    (mirror_root / "m" / "outside").symlink_to(tmp_path)
    r = as_node.get(byte_listener + "m/v1/escape.gguf")
    assert r.status_code == 404
    assert b"do not serve me" not in r.content
    assert "escape.gguf" not in [f["name"] for f in as_node.get(byte_listener + "m/v1/").json()["files"]]
    assert as_node.get(byte_listener + "m/outside/").status_code == 404
    assert as_node.get(byte_listener + "m/outside/secret.txt").status_code == 404


def test_a_symlink_inside_the_mirror_serves_only_what_the_mirror_would_serve(
    byte_listener, mirror_version, mirror_root
):
    (mirror_root / ".env").write_bytes(b"DJANGO_SECRET_KEY=hidden")
    (mirror_version / "model.gguf.part").write_bytes(b"half a download")
    (mirror_root / "m" / "v1" / "nested").mkdir()
    (mirror_root / "m" / "v1" / "nested" / "deep.bin").write_bytes(b"not a version's file")
    (mirror_version / "link").symlink_to(mirror_root / ".env")
    (mirror_version / "part-link").symlink_to(mirror_version / "model.gguf.part")
    (mirror_version / "deep-link").symlink_to(mirror_version / "nested" / "deep.bin")
    (mirror_version / "alias.gguf").symlink_to(mirror_version / "model.gguf")
    (mirror_root / "m" / "hidden-version").symlink_to(mirror_root / "m" / "v1" / "nested")
    for name in ("link", "part-link", "deep-link"):
        r = as_node.get(byte_listener + "m/v1/" + name)
        assert r.status_code == 404, name
        assert b"hidden" not in r.content and b"half" not in r.content and b"not a version" not in r.content
    names = [f["name"] for f in as_node.get(byte_listener + "m/v1/").json()["files"]]
    # A link to a file the mirror serves anyway is served, like the file.
    assert sorted(names) == ["alias.gguf", "b.bin", "model.gguf"]
    assert as_node.get(byte_listener + "m/v1/alias.gguf").content == CONTENT
    assert as_node.get(byte_listener + "m/hidden-version/").status_code == 404


def test_only_get_and_head_are_answered(byte_listener, mirror_version):
    r = as_node.post(byte_listener + "m/v1/model.gguf", data=b"x")
    assert r.status_code == 405
    assert "GET and HEAD" in r.json()["error"]


def test_the_byte_listener_has_no_admin_and_no_api(byte_listener, mirror_version):
    for path in ("admin/", "api/mirror/versions/", "api/schema/"):
        r = as_node.get(byte_listener + path)
        assert r.status_code == 404
        assert "error" in r.json()


def test_a_download_longer_than_the_worker_timeout_is_not_cut(mirror_root, tmp_path, fleet_node):
    """A slow node reading for longer than gunicorn's worker timeout still gets every byte."""
    import time

    from .support.processes import start_byte_listener

    # Far more than loopback's socket buffers hold, so the server is still sending at the end.
    content = os.urandom(64 << 20)
    put(mirror_root, "big", "v1", {"w.gguf": content})
    process, url = start_byte_listener(mirror_root, tmp_path, LLMGW_BYTES_WORKER_TIMEOUT_S=1)
    try:
        received = bytearray()
        started = time.monotonic()
        with as_node.get(url + "big/v1/w.gguf", stream=True, timeout=30) as r:
            for chunk in r.iter_content(1 << 20):
                received += chunk
                time.sleep(0.07)  # about 4.5 s in all: four times the timeout
        assert time.monotonic() - started > 3
        assert bytes(received) == content
    finally:
        process.stop()
