"""The mirror in the admin: what staff see of versions and their files."""

import hashlib

import pytest

from mirror import scan
from mirror.models import MirrorVersion

from .support.mirror import put

pytestmark = pytest.mark.django_db


def test_the_version_list_shows_files_size_state_and_last_scan(staff_client, mirror_root):
    put(mirror_root, "llama", "q4", {"a.gguf": b"1" * 3000, "b.gguf": b"2" * 2000})
    put(mirror_root, "llama", "q8", {"a.gguf": b"3" * 10})
    scan.scan_mirror()
    from mirror.models import MirrorFile

    scan.hash_file(MirrorFile.objects.get(version__version="q8").pk)
    page = staff_client.get("/admin/mirror/mirrorversion/").content.decode()
    assert '<td class="field-version">q4</td>' in page
    assert '<td class="field-file_count">2</td>' in page
    assert "4.9\xa0KB" in page  # 5,000 bytes, human-readable
    assert '<td class="field-state">hashing (0 of 2 hashed)</td>' in page
    assert '<td class="field-state">complete</td>' in page
    assert "field-scanned_at" in page


def test_a_version_page_lists_each_file_with_its_size_and_hash(staff_client, mirror_root):
    put(mirror_root, "llama", "q4", {"a.gguf": b"1" * 3000})
    for file_id in scan.scan_mirror().to_hash:
        scan.hash_file(file_id)
    version = MirrorVersion.objects.get()
    page = staff_client.get(f"/admin/mirror/mirrorversion/{version.pk}/change/").content.decode()
    assert "a.gguf" in page
    assert "3,000 bytes" in page
    assert hashlib.sha256(b"1" * 3000).hexdigest() in page
    assert "complete" in page
    assert f"{version.address}" in page
    assert 'id="serve-button"' in page


def test_the_scan_button_indexes_a_hand_copy_and_says_what_it_found(staff_client, mirror_root):
    put(mirror_root, "llama", "q4", {"a.gguf": b"1"})
    (mirror_root / "llama" / "bad\\name").mkdir()
    response = staff_client.post("/admin/mirror/mirrorversion/scan/", follow=True)
    page = response.content.decode()
    assert MirrorVersion.objects.filter(model="llama", version="q4").exists()
    assert "1 added" in page
    assert "is not indexed" in page and "separator" in page


def test_staff_cannot_delete_or_add_a_version_by_hand(staff_client, mirror_root):
    put(mirror_root, "llama", "q4", {"a.gguf": b"1"})
    scan.scan_mirror()
    version = MirrorVersion.objects.get()
    assert staff_client.get(f"/admin/mirror/mirrorversion/{version.pk}/delete/").status_code == 403
    assert staff_client.get("/admin/mirror/mirrorversion/add/").status_code == 403
