"""Issue 24, item 1: the mirror describes each version as a BitTorrent v2 torrent.

A real byte listener: the manifest gives the torrent's info-hash and address, the
torrent (node pass required) is v2, private, in 4 MiB pieces, and names exactly the
manifest's files; it is kept in the index, not beside the weights; a file copied in by
hand changes it; the control worker's hash task makes it too; and a node refuses a
torrent that disagrees with the manifest, saying how.
"""

from __future__ import annotations

import hashlib
import os

import libtorrent as lt
import pytest
import requests

from agent.sources import Entry, FetchError
from agent.torrents import checked_torrent
from mirror import scan, tasks
from mirror.models import MirrorVersion

from .support.mirror import put
from .support.processes import NoAuth, as_node

pytestmark = pytest.mark.django_db(transaction=True)

MIB = 1 << 20


def data(name: str, size: int) -> bytes:
    seed = hashlib.sha256(name.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


FILES = {"model-00001-of-00002.safetensors": data("one", 5 * MIB + 3), "config.json": b'{"a": 1}'}


def torrent_of(url: str) -> tuple[dict, bytes]:
    manifest = as_node.get(url, timeout=10)
    assert manifest.status_code == 200, manifest.text
    body = manifest.json()
    got = as_node.get(body["torrent"]["url"], timeout=10)
    assert got.status_code == 200 and got.headers["Content-Type"] == "application/x-bittorrent"
    return body, got.content


def test_the_manifest_gives_a_v2_private_torrent_that_names_exactly_its_files(byte_listener, mirror_root):
    directory = put(mirror_root, "m", "v1", FILES)
    manifest, raw = torrent_of(byte_listener + "m/v1/")
    assert manifest["torrent"]["url"] == byte_listener + "m/v1/?torrent"
    assert manifest["torrent"]["piece_bytes"] == 4 * MIB
    info = lt.torrent_info(lt.bdecode(raw))
    assert info.info_hashes().has_v2() and not info.info_hashes().has_v1()
    assert str(info.info_hashes().v2) == manifest["torrent"]["info_hash"]
    assert info.priv() and info.piece_length() == 4 * MIB and info.layout().name() == "v1"
    entries = [Entry(f["name"], f["bytes"], f["sha256"]) for f in manifest["files"]]
    checked_torrent(raw, "m/v1/", "v1", entries, manifest["torrent"]["info_hash"])  # agrees: no error
    # Kept in the index, never beside the weights.
    assert MirrorVersion.objects.get().torrent_info_hash == manifest["torrent"]["info_hash"]
    assert sorted(os.listdir(directory)) == sorted(FILES)
    # Only the fleet gets it.
    assert requests.get(byte_listener + "m/v1/?torrent", auth=NoAuth(), timeout=5).status_code == 401


def test_the_torrent_verifies_the_bytes_of_the_files_themselves(byte_listener, mirror_root, tmp_path):
    put(mirror_root, "m", "v1", FILES)
    _, raw = torrent_of(byte_listener + "m/v1/")
    info = lt.torrent_info(lt.bdecode(raw))
    # The same files made into a torrent here give the same info-hash: it is of their bytes.
    (tmp_path / "v1").mkdir()
    for name, content in FILES.items():
        (tmp_path / "v1" / name).write_bytes(content)
    entries = [lt.create_file_entry(f"v1/{name}", len(c)) for name, c in sorted(FILES.items())]
    mine = lt.create_torrent(entries, 4 * MIB, lt.create_torrent.v2_only)
    mine.set_priv(True)
    lt.set_piece_hashes(mine, str(tmp_path))
    assert lt.torrent_info(lt.bencode(mine.generate())).info_hashes().v2 == info.info_hashes().v2


def test_a_file_copied_in_by_hand_changes_the_torrent(byte_listener, mirror_root):
    put(mirror_root, "m", "v1", FILES)
    before, _ = torrent_of(byte_listener + "m/v1/")
    put(mirror_root, "m", "v1", {"config.json": b'{"a": 2}'})
    after, raw = torrent_of(byte_listener + "m/v1/")
    assert after["torrent"]["info_hash"] != before["torrent"]["info_hash"]
    entries = [Entry(f["name"], f["bytes"], f["sha256"]) for f in after["files"]]
    checked_torrent(raw, "m/v1/", "v1", entries, after["torrent"]["info_hash"])


def test_the_control_workers_hash_task_makes_the_torrent_when_the_last_file_is_hashed(mirror_root):
    put(mirror_root, "m", "v1", FILES)
    ids = scan.scan_mirror().to_hash
    tasks.hash_task(ids[0])
    assert MirrorVersion.objects.get().torrent_info_hash == ""  # not every file hashed yet
    tasks.hash_task(ids[1])
    row = MirrorVersion.objects.get()
    assert len(row.torrent_info_hash) == 64 and lt.torrent_info(lt.bdecode(bytes(row.torrent))).num_pieces() >= 2


def _torrent(tmp_path, files: dict[str, bytes], root: str = "v1", private: bool = True) -> tuple[bytes, str]:
    (tmp_path / root).mkdir(exist_ok=True)
    for name, content in files.items():
        (tmp_path / root / name).write_bytes(content)
    entries = [lt.create_file_entry(f"{root}/{n}", len(c)) for n, c in sorted(files.items())]
    made = lt.create_torrent(entries, 4 * MIB, lt.create_torrent.v2_only)
    made.set_priv(private)
    lt.set_piece_hashes(made, str(tmp_path))
    raw = lt.bencode(made.generate())
    return raw, str(lt.torrent_info(lt.bdecode(raw)).info_hashes().v2)


@pytest.mark.parametrize(
    "files, root, private, sentence",
    [
        ({"a.bin": b"a" * 10}, "v1", True, "it lacks b.bin"),
        (
            {"a.bin": b"a" * 10, "b.bin": b"b" * 5, "x.py": b"x"},
            "v1",
            True,
            "it names x.py, which the manifest does not",
        ),
        ({"a.bin": b"a" * 11, "b.bin": b"b" * 5}, "v1", True, "a.bin is 11 bytes in it and 10 in the manifest"),
        ({"a.bin": b"a" * 10, "b.bin": b"b" * 5}, "v2", True, "is for the folder 'v2', not 'v1'"),
        ({"a.bin": b"a" * 10, "b.bin": b"b" * 5}, "v1", False, "is not private"),
    ],
    ids=["a file missing", "a file extra", "a size wrong", "another folder", "not private"],
)
def test_a_torrent_that_disagrees_with_the_manifest_is_refused_with_a_sentence(
    tmp_path, files, root, private, sentence
):
    entries = [Entry("a.bin", 10, "0" * 64), Entry("b.bin", 5, "1" * 64)]
    raw, info_hash = _torrent(tmp_path, files, root, private)
    with pytest.raises(FetchError) as refused:
        checked_torrent(raw, "http://mirror/m/v1/", "v1", entries, info_hash)
    assert sentence in str(refused.value) and "refused" in str(refused.value)


def test_a_torrent_with_another_info_hash_than_the_manifest_or_none_at_all_is_refused(tmp_path):
    entries = [Entry("a.bin", 10, "0" * 64)]
    raw, info_hash = _torrent(tmp_path, {"a.bin": b"a" * 10})
    with pytest.raises(FetchError) as refused:
        checked_torrent(raw, "http://mirror/m/v1/", "v1", entries, "f" * 64)
    assert f"has the info-hash {info_hash}, not the manifest's {'f' * 64}" in str(refused.value)
    with pytest.raises(FetchError) as refused:
        checked_torrent(b"<html>", "http://mirror/m/v1/", "v1", entries, info_hash)
    assert "is not a torrent" in str(refused.value)


def test_the_byte_listener_takes_a_nodes_pass_as_the_basic_credentials_a_web_seed_sends(
    byte_listener, mirror_root, fleet_node
):
    """libtorrent sends a web seed URL's `user:password@` as HTTP Basic: the node's name and its pass."""
    import time

    from contracts import credentials, signing

    put(mirror_root, "m", "v1", FILES)
    name, token = fleet_node
    key = signing.token_hash(token)
    url = byte_listener + "m/v1/config.json"
    good = requests.get(url, auth=(name, credentials.bytes_pass(key, name)), timeout=5)
    assert good.status_code == 200 and good.content == FILES["config.json"]
    ranged = requests.get(
        url, auth=(name, credentials.bytes_pass(key, name)), headers={"Range": "bytes=1-3"}, timeout=5
    )
    assert ranged.status_code == 206 and ranged.content == FILES["config.json"][1:4]

    def refused(user: str, password: str) -> str:
        answer = requests.get(url, auth=(user, password), timeout=5)
        assert answer.status_code == 401, (user, password)
        return answer.json()["error"]

    assert "names the node as its user" in refused(name, token)
    assert "names the node as its user" in refused("other", credentials.bytes_pass(key, name))
    assert "expired" in refused(name, credentials.bytes_pass(key, name, now=time.time() - 7200))
    assert "not one of node" in refused(name, credentials.bytes_pass(signing.token_hash("a guess"), name))
