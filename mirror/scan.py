"""Reconcile the index with the directory, and hash what needs hashing."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from datetime import timedelta

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from contracts.digest import sha256_file
from contracts.names import plain_name_problem

from . import disk
from .models import MirrorFile, MirrorVersion

log = logging.getLogger(__name__)


@dataclass
class ScanReport:
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # sentences: which and why
    to_hash: list[int] = field(default_factory=list)

    def summary(self) -> str:
        parts = [
            f"{len(self.added)} added",
            f"{len(self.removed)} removed",
            f"{len(self.changed)} changed",
            f"{len(self.skipped)} skipped",
        ]
        return ", ".join(parts)


def _skipped_names(directory, where: str) -> list[str]:
    """Sentences for each entry of a directory that is not indexed because of its name."""
    sentences = []
    try:
        entries = sorted(os.listdir(directory))
    except OSError:
        return sentences
    for name in entries:
        problem = plain_name_problem(name)
        if problem is None:
            continue
        # Hidden files and unfinished downloads are expected in a mirror; they
        # are not a mistake to report, just not part of any version.
        if name.startswith(".") or name.endswith(".part"):
            continue
        sentences.append(f"{where}{name!r} is not indexed: {problem}")
    return sentences


def scan_mirror() -> ScanReport:
    """Make MirrorVersion and MirrorFile match what is on disk now."""
    report = ScanReport()
    now = timezone.now()
    root = disk.root()
    root.mkdir(parents=True, exist_ok=True)
    report.skipped += _skipped_names(root, "")

    seen_versions: set[tuple[str, str]] = set()
    for model in disk.model_names():
        report.skipped += _skipped_names(root / model, f"{model}/")
        for version in disk.version_names(model):
            report.skipped += _skipped_names(root / model / version, f"{model}/{version}/")
            files = disk.version_files(model, version)
            if files is None:
                continue
            seen_versions.add((model, version))
            _reconcile_version(model, version, files, now, report)

    for row in MirrorVersion.objects.all():
        if (row.model, row.version) not in seen_versions:
            report.removed.append(str(row))
            row.delete()
    for sentence in report.skipped:
        log.warning("mirror scan: %s", sentence)
    return report


@transaction.atomic
def _reconcile_version(model, version, files, now, report: ScanReport) -> None:
    row, created = MirrorVersion.objects.get_or_create(model=model, version=version, defaults={"scanned_at": now})
    if created:
        report.added.append(str(row))
    else:
        row.scanned_at = now
        row.save(update_fields=["scanned_at"])

    indexed = {f.name: f for f in row.files.all()}
    on_disk = {f.name for f in files}
    for gone in set(indexed) - on_disk:
        indexed[gone].delete()
        report.changed.append(f"{row}/{gone} removed")
    for f in files:
        existing = indexed.get(f.name)
        if existing is None:
            new = MirrorFile.objects.create(version=row, name=f.name, bytes=f.bytes, mtime_ns=f.mtime_ns)
            report.to_hash.append(new.pk)
            if not created:
                report.changed.append(f"{row}/{f.name} added")
        elif existing.bytes != f.bytes or existing.mtime_ns != f.mtime_ns:
            existing.bytes, existing.mtime_ns = f.bytes, f.mtime_ns
            existing.sha256, existing.hashed_at = "", None
            existing.save()
            report.to_hash.append(existing.pk)
            report.changed.append(f"{row}/{f.name} changed")
        elif not existing.sha256:
            report.to_hash.append(existing.pk)


def hash_file(file_id: int) -> str | None:
    """Compute and store one file's sha256, if it is still the content the index describes.

    Computed once per content: the hash is stored only when the file's size and
    mtime are the same before and after reading it and still match the row, so
    a file being copied in while we read it is hashed again later, never wrongly.
    """
    row = MirrorFile.objects.select_related("version").filter(pk=file_id).first()
    if row is None or row.sha256:
        return row.sha256 if row else None
    if not _claim(row):
        return None
    try:
        return _hash_claimed(row)
    finally:
        MirrorFile.objects.filter(pk=file_id).update(hashing_since=None)


def _claim(row: MirrorFile) -> bool:
    """Take the file for hashing unless another worker has it (or had it, and died)."""
    now = timezone.now()
    # Generous: a worker reading at 50 MB/s, plus ten minutes.
    stale = now - timedelta(seconds=600 + row.bytes / 50e6)
    claimed = (
        MirrorFile.objects.filter(pk=row.pk, sha256="")
        .filter(Q(hashing_since__isnull=True) | Q(hashing_since__lt=stale))
        .update(hashing_since=now)
    )
    return claimed == 1


def _hash_claimed(row: MirrorFile) -> str | None:
    file_id = row.pk
    path = disk.resolve(row.version.model, row.version.version, row.name)
    if path is None:
        return None
    try:
        before = os.stat(path)
        if before.st_size != row.bytes or before.st_mtime_ns != row.mtime_ns:
            return None
        digest = sha256_file(path)
        after = os.stat(path)
    except OSError:
        return None
    if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
        return None
    changed = MirrorFile.objects.filter(
        pk=file_id, bytes=before.st_size, mtime_ns=before.st_mtime_ns, sha256=""
    ).update(sha256=digest, hashed_at=timezone.now())
    return digest if changed == 1 else None


def known_hashes(model: str, version: str) -> dict[str, tuple[int, int, str]]:
    """name -> (bytes, mtime_ns, sha256) for the hashed files of a version in the index."""
    rows = MirrorFile.objects.filter(version__model=model, version__version=version).exclude(sha256="")
    return {r.name: (r.bytes, r.mtime_ns, r.sha256) for r in rows}
