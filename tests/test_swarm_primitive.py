"""contracts/swarm/, the download primitive (issue 24), between real libtorrent sessions on loopback.

Every session here is a real one listening on its own port; what the agents do with it
over network namespaces is in tests/test_swarm_fleet.py.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import libtorrent as lt
import pytest

from contracts.swarm import Swarm, SwarmError

MIB = 1 << 20
PIECE = 4 * MIB


def content(name: str, size: int) -> bytes:
    seed = hashlib.sha256(name.encode()).digest()
    block = b"".join(hashlib.sha256(seed + i.to_bytes(4, "big")).digest() for i in range(2048))
    return (block * (size // len(block) + 1))[:size]


FILES = {"a.bin": content("a", 9 * MIB + 7), "b.bin": content("b", 5 * MIB), "config.json": b'{"n": 1}'}


def version_dir(root: Path, files: dict[str, bytes] = FILES) -> Path:
    directory = root / "v1"
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (directory / name).write_bytes(data)
    return directory


def torrent_of(directory: Path) -> bytes:
    """As the mirror makes it (mirror/torrent.py): v2 only, private, 4 MiB pieces, rooted at the version's name."""
    entries = [
        lt.create_file_entry(f"{directory.name}/{p.name}", p.stat().st_size) for p in sorted(directory.iterdir())
    ]
    creator = lt.create_torrent(entries, PIECE, lt.create_torrent.v2_only)
    creator.set_priv(True)
    lt.set_piece_hashes(creator, str(directory.parent))
    return lt.bencode(creator.generate())


@pytest.fixture
def sessions():
    made: list[Swarm] = []

    def make() -> Swarm:
        made.append(Swarm(0, "127.0.0.1"))
        return made[-1]

    yield make
    for swarm in made:
        swarm.close()


def same_files(directory: Path, files: dict[str, bytes] = FILES) -> None:
    assert sorted(p.name for p in directory.iterdir() if not p.name.startswith(".")) == sorted(files)
    for name, data in files.items():
        assert (directory / name).read_bytes() == data, name


def test_a_set_fetched_from_a_peer_is_byte_identical_and_lands_straight_in_the_directory(tmp_path, sessions):
    source = version_dir(tmp_path / "seeder")
    torrent = torrent_of(source)
    seeder, fetcher = sessions(), sessions()
    seeder.seed(torrent, source)
    done = fetcher.fetch(torrent, tmp_path / "got", peers=[("127.0.0.1", seeder.listen_port)], stall_s=5)
    same_files(tmp_path / "got")
    assert done.bytes_total == sum(map(len, FILES.values()))
    assert done.bytes_from_peers >= done.bytes_total and done.bytes_from_web_seeds == 0
    # And it seeds what it fetched: a third session gets the set from it alone.
    third = sessions()
    third.fetch(torrent, tmp_path / "third", peers=[("127.0.0.1", fetcher.listen_port)], stall_s=5)
    same_files(tmp_path / "third")


def test_a_peer_that_serves_a_corrupted_piece_is_caught_by_its_hash_and_banned(tmp_path, sessions):
    honest = version_dir(tmp_path / "honest")
    torrent = torrent_of(honest)
    # The liar holds the same set with one byte flipped in the middle of a.bin's second
    # piece, and seeds it as whole (seed() trusts the files, as an agent trusts its
    # verified cache): the bytes it sends for that piece are wrong.
    rotten = version_dir(tmp_path / "rotten")
    with open(rotten / "a.bin", "r+b") as fh:
        fh.seek(PIECE + 12345)
        byte = fh.read(1)
        fh.seek(PIECE + 12345)
        fh.write(bytes([byte[0] ^ 0xFF]))
    liar, good, fetcher = sessions(), sessions(), sessions()
    liar.seed(torrent, rotten)
    good.seed(torrent, honest)
    # The liar first and alone for a moment, so that it is the one asked for that piece.
    events: list[str] = []
    asked_good = []

    def progress(status):
        events.extend(status.events)
        if not asked_good and (status.pieces_done or events):
            asked_good.append(True)

    peers = lambda: [("127.0.0.1", liar.listen_port)] + ([("127.0.0.1", good.listen_port)] if asked_good else [])  # noqa: E731
    done = fetcher.fetch(torrent, tmp_path / "got", peers=peers, progress=progress, stall_s=5)
    same_files(tmp_path / "got")
    assert done.banned == [f"peer 127.0.0.1:{liar.listen_port}"], (done, events)
    assert any("failed its hash" in e for e in events), events


def test_a_fetch_stopped_halfway_resumes_with_only_the_pieces_it_had_not_verified(tmp_path, sessions):
    big = {"w.bin": content("w", 40 * MIB), "x.bin": content("x", 1 * MIB)}
    source = version_dir(tmp_path / "seeder", big)
    torrent = torrent_of(source)
    seeder = sessions()
    # Slow enough to stop halfway (a torrent's own limit: libtorrent exempts local peers from the session's).
    seeding = seeder.handle(seeder.seed(torrent, source))
    seeding.set_upload_limit(8 * MIB)
    first = sessions()
    resume = tmp_path / "got.resume"

    class Stop(Exception):
        pass

    seen = {}

    def stop_halfway(status):
        seen["pieces"] = status.pieces_done
        if status.pieces_done >= 4:
            raise Stop

    with pytest.raises(Stop):
        first.fetch(
            torrent,
            tmp_path / "got",
            peers=[("127.0.0.1", seeder.listen_port)],
            progress=stop_halfway,
            resume_path=resume,
        )
    assert resume.exists()
    first.close()
    verified = lt.read_resume_data(resume.read_bytes()).have_pieces
    kept = sum(1 for have in verified if have)
    assert 4 <= kept < 11, kept  # 41 MiB: 11 pieces (a file's last piece is its own)
    seeding.set_upload_limit(-1)  # the limit was only to stop halfway: the rest at full speed
    again = sessions()
    done = again.fetch(torrent, tmp_path / "got", peers=[("127.0.0.1", seeder.listen_port)], resume_path=resume)
    same_files(tmp_path / "got", big)
    # Only the pieces not verified came again (at most a whole piece each): every verified one was kept.
    assert done.bytes_from_peers <= (11 - kept) * PIECE, (done, kept)


def test_a_resume_record_is_held_to_the_files_on_disk_and_what_a_file_lost_is_fetched_again(tmp_path, sessions):
    source = version_dir(tmp_path / "seeder")
    torrent = torrent_of(source)
    seeder, fetcher = sessions(), sessions()
    seeder.seed(torrent, source)
    resume = tmp_path / "got.resume"
    peers = [("127.0.0.1", seeder.listen_port)]
    fetcher.fetch(torrent, tmp_path / "got", peers=peers, resume_path=resume, keep_seeding=False)
    # Whole by the record, and then a.bin cut short: its first piece still there, the rest gone.
    with open(tmp_path / "got" / "a.bin", "r+b") as fh:
        fh.truncate(PIECE + 10)
    assert all(lt.read_resume_data(resume.read_bytes()).have_pieces[:4])
    done = fetcher.fetch(torrent, tmp_path / "got", peers=peers, resume_path=resume)
    same_files(tmp_path / "got")
    # The pieces the file lost, and not the one it kept nor any of b.bin's.
    assert done.bytes_from_peers == len(FILES["a.bin"]) - PIECE, done


def test_an_address_not_allowed_gets_no_piece(tmp_path, sessions):
    source = version_dir(tmp_path / "seeder")
    torrent = torrent_of(source)
    seeder, stranger = sessions(), sessions()
    seeder.allow(["10.255.255.1"])  # some node; not 127.0.0.1, where the stranger is
    seeder.seed(torrent, source)
    with pytest.raises(SwarmError, match="nothing arrived for 3 s: no source answered"):
        stranger.fetch(torrent, tmp_path / "got", peers=[("127.0.0.1", seeder.listen_port)], stall_s=1, give_up_s=3)
    got = tmp_path / "got"
    assert not any((got / n).exists() and (got / n).read_bytes() == FILES[n] for n in FILES)


def test_a_torrent_that_is_not_one_is_refused_with_a_sentence(tmp_path, sessions):
    with pytest.raises(SwarmError, match="not a torrent"):
        sessions().fetch(b"<html>", tmp_path / "got")
