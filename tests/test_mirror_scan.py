"""The mirror's index follows the directory: scans, hashing, and what is refused."""

import hashlib
import os
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from mirror import scan
from mirror.models import MirrorFile, MirrorVersion

from .support.mirror import put
from .support.queries import writes
from .support.waiting import wait_until

pytestmark = pytest.mark.django_db


def test_a_hand_copied_version_appears_with_its_files(mirror_root):
    put(mirror_root, "llama", "q4", {"a.gguf": b"1" * 100, "b.gguf": b"2" * 50})
    report = scan.scan_mirror()
    assert report.added == ["llama/q4"]
    version = MirrorVersion.objects.with_totals().get(model="llama", version="q4")
    assert version.file_count == 2
    assert version.total_bytes == 150
    assert version.state == MirrorVersion.State.HASHING


def test_a_deleted_version_disappears(mirror_root):
    directory = put(mirror_root, "llama", "q4", {"a.gguf": b"1"})
    scan.scan_mirror()
    for f in directory.iterdir():
        f.unlink()
    directory.rmdir()
    report = scan.scan_mirror()
    assert report.removed == ["llama/q4"]
    assert not MirrorVersion.objects.exists()


def test_a_changed_file_gets_its_new_size_and_loses_its_hash(mirror_root):
    directory = put(mirror_root, "llama", "q4", {"a.gguf": b"1" * 10})
    for file_id in scan.scan_mirror().to_hash:
        scan.hash_file(file_id)
    row = MirrorFile.objects.get()
    assert row.sha256 == hashlib.sha256(b"1" * 10).hexdigest()

    (directory / "a.gguf").write_bytes(b"2" * 20)
    os.utime(directory / "a.gguf", ns=(row.mtime_ns + 10**9, row.mtime_ns + 10**9))
    report = scan.scan_mirror()
    row.refresh_from_db()
    assert row.bytes == 20
    assert row.sha256 == ""
    assert report.to_hash == [row.pk]
    scan.hash_file(row.pk)
    row.refresh_from_db()
    assert row.sha256 == hashlib.sha256(b"2" * 20).hexdigest()


def test_an_unchanged_file_is_hashed_once(mirror_root):
    put(mirror_root, "llama", "q4", {"a.gguf": b"1" * 10})
    for file_id in scan.scan_mirror().to_hash:
        scan.hash_file(file_id)
    assert scan.scan_mirror().to_hash == []


def test_a_file_that_changed_since_the_scan_is_not_given_a_hash(mirror_root):
    directory = put(mirror_root, "llama", "q4", {"a.gguf": b"1" * 10})
    file_id = scan.scan_mirror().to_hash[0]
    (directory / "a.gguf").write_bytes(b"still being copied in")
    assert scan.hash_file(file_id) is None
    assert MirrorFile.objects.get().sha256 == ""


def test_names_that_are_not_plain_are_not_indexed_and_the_scan_says_why(mirror_root):
    put(mirror_root, "good", "v1", {"w.gguf": b"1", "bad\\name.gguf": b"2", "half.gguf.part": b"3", ".hidden": b"4"})
    (mirror_root / "bad\nmodel").mkdir()
    report = scan.scan_mirror()
    assert [f.name for f in MirrorFile.objects.all()] == ["w.gguf"]
    assert any("bad\\\\name.gguf" in s and "separator" in s for s in report.skipped), report.skipped
    assert any("control character" in s for s in report.skipped), report.skipped
    # Unfinished downloads and hidden files are normal in a mirror, not mistakes.
    assert not any("half.gguf.part" in s or ".hidden" in s for s in report.skipped)


def test_a_symlinked_version_outside_the_root_is_not_indexed(mirror_root, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "w.gguf").write_bytes(b"1")
    (mirror_root / "m").mkdir()
    (mirror_root / "m" / "v1").symlink_to(outside)
    scan.scan_mirror()
    assert not MirrorVersion.objects.exists()


def test_the_scan_command_reports_and_hashes(mirror_root, capsys):
    put(mirror_root, "llama", "q4", {"a.gguf": b"abc"})
    call_command("mirror_scan")
    out = capsys.readouterr().out
    assert "added llama/q4" in out
    assert "1 added" in out
    assert MirrorFile.objects.get().sha256 == hashlib.sha256(b"abc").hexdigest()


@pytest.mark.django_db(transaction=True)
def test_a_celery_worker_scans_and_hashes_in_the_background(mirror_root, control_worker):
    from mirror.tasks import scan_task

    put(mirror_root, "llama", "q4", {"a.gguf": b"x" * 4096, "b.gguf": b"y" * 10})
    scan_task.delay()

    def hashed():
        return MirrorFile.objects.exclude(sha256="").count() == 2

    wait_until(hashed, timeout=30, what="the worker to hash both files")
    version = MirrorVersion.objects.get()
    assert version.state == MirrorVersion.State.COMPLETE
    assert MirrorFile.objects.get(name="a.gguf").sha256 == hashlib.sha256(b"x" * 4096).hexdigest()


# --- a scan costs what changed, not what exists ------------------------------------


def test_a_scan_of_an_unchanged_mirror_reads_the_index_once_and_writes_nothing(mirror_root):
    for n in range(20):
        put(mirror_root, f"m{n % 4}", f"v{n}", {"a.gguf": b"1", "b.gguf": b"22"})
    for file_id in scan.scan_mirror().to_hash:
        scan.hash_file(file_id)
    scanned_at = dict(MirrorVersion.objects.values_list("pk", "scanned_at"))

    with CaptureQueriesContext(connection) as queries:
        report = scan.scan_mirror()
    assert report.summary() == "0 added, 0 removed, 0 changed, 0 skipped"
    assert report.to_hash == []
    assert len(queries) == 1, [q["sql"] for q in queries]
    assert writes(queries) == []
    assert dict(MirrorVersion.objects.values_list("pk", "scanned_at")) == scanned_at


def test_changes_across_many_versions_are_written_in_a_few_statements_not_one_per_file(mirror_root):
    directories = [put(mirror_root, "m", f"v{n}", {"a.gguf": b"1", "b.gguf": b"2"}) for n in range(30)]
    scan.scan_mirror()
    later = MirrorFile.objects.first().mtime_ns + 10**9
    for directory in directories[:10]:
        (directory / "a.gguf").write_bytes(b"changed")
        os.utime(directory / "a.gguf", ns=(later, later))
        (directory / "b.gguf").unlink()
        (directory / "c.gguf").write_bytes(b"new")

    with CaptureQueriesContext(connection) as queries:
        report = scan.scan_mirror()
    assert len(report.changed) == 30
    # 10 changed and 10 new, and the two unhashed files of each of the 20 untouched versions
    assert len(report.to_hash) == 10 + 10 + 40
    # One bulk insert, one bulk update, one delete, one update of the versions' scanned_at.
    assert len(writes(queries)) <= 5, writes(queries)
    assert MirrorFile.objects.filter(name="a.gguf", bytes=7).count() == 10
    assert not MirrorFile.objects.filter(name="b.gguf", version__version__in=[f"v{n}" for n in range(10)]).exists()
    assert MirrorFile.objects.filter(name="c.gguf").count() == 10


def test_a_version_is_marked_scanned_when_a_scan_finds_it_changed(mirror_root):
    directory = put(mirror_root, "llama", "q4", {"a.gguf": b"1"})
    put(mirror_root, "llama", "q8", {"a.gguf": b"1"})
    scan.scan_mirror()
    MirrorVersion.objects.update(scanned_at=timezone.now() - timedelta(days=1))
    (directory / "b.gguf").write_bytes(b"2")
    report = scan.scan_mirror()
    assert report.changed == ["llama/q4/b.gguf added"]
    fresh = MirrorVersion.objects.filter(scanned_at__gt=timezone.now() - timedelta(minutes=1))
    assert list(fresh.values_list("version", flat=True)) == ["q4"]


def test_a_symlink_to_a_file_inside_the_root_is_indexed_and_one_outside_is_not(mirror_root, tmp_path):
    put(mirror_root, "m", "v1", {"w.gguf": b"12345"})
    outside = tmp_path / "secret.gguf"
    outside.write_bytes(b"secret")
    directory = put(mirror_root, "m", "v2", {})
    (directory / "w.gguf").symlink_to(mirror_root / "m" / "v1" / "w.gguf")
    (directory / "s.gguf").symlink_to(outside)
    scan.scan_mirror()
    assert list(MirrorFile.objects.filter(version__version="v2").values_list("name", "bytes")) == [("w.gguf", 5)]
