"""Reconcile the index with the directory, and hash what needs hashing.

A scan runs every few seconds over a mirror of tens of thousands of files, so
it costs what changed, not what exists: one walk of the tree with scandir and
stat, the whole index read in one query, compared in memory, and only the
differences written, in bulk. A version whose files are as the index has them
costs no write at all.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from datetime import timedelta

from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from contracts.digest import sha256_file
from contracts.names import plain_name_problem

from . import disk, headers
from .models import MirrorFile, MirrorVersion

log = logging.getLogger(__name__)

# Rows per statement for bulk writes and `pk IN (...)`: well under SQLite's variable limit.
BATCH = 500


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


# --- the disk: one walk -----------------------------------------------------------

# name -> (bytes, mtime_ns), for the files of one version as they are on disk now.
Listing = dict[str, tuple[int, int]]


def _plain_entries(directory, where: str, report: ScanReport) -> list[os.DirEntry]:
    """A directory's entries with plain names, by name; each other name said in `report.skipped`."""
    try:
        with os.scandir(directory) as it:
            entries = sorted(it, key=lambda e: e.name)
    except OSError:
        return []
    plain = []
    for entry in entries:
        problem = plain_name_problem(entry.name)
        if problem is None:
            plain.append(entry)
        # Hidden files and unfinished downloads are expected in a mirror; they
        # are not a mistake to report, just not part of any version.
        elif not (entry.name.startswith(".") or entry.name.endswith(".part")):
            report.skipped.append(f"{where}{entry.name!r} is not indexed: {problem}")
    return plain


def _is_plain_dir(entry: os.DirEntry) -> bool:
    """A real directory, reached without a symlink: inside the root by construction."""
    return not entry.is_symlink() and entry.is_dir(follow_symlinks=False)


def _slow_listing(model: str, version: str) -> Listing | None:
    """A version reached through a symlink: disk.py decides what it really is and whether it may be served."""
    files = disk.version_files(model, version)
    return None if files is None else {f.name: (f.bytes, f.mtime_ns) for f in files}


def _version_listing(entry: os.DirEntry, model: str, report: ScanReport) -> Listing | None:
    listing: Listing = {}
    for f in _plain_entries(entry.path, f"{model}/{entry.name}/", report):
        if f.is_symlink():
            # A link may point anywhere; the rare version holding one is read the careful way.
            return _slow_listing(model, entry.name)
        if not f.is_file(follow_symlinks=False):
            continue
        try:
            st = f.stat(follow_symlinks=False)
        except OSError:
            continue
        listing[f.name] = (st.st_size, st.st_mtime_ns)
    return listing


def walk(report: ScanReport) -> dict[tuple[str, str], Listing]:
    """(model, version) -> its files, for every version on disk now; names not indexed go to the report."""
    root = disk.root()
    root.mkdir(parents=True, exist_ok=True)
    found: dict[tuple[str, str], Listing] = {}
    for model_entry in _plain_entries(root, "", report):
        model = model_entry.name
        if _is_plain_dir(model_entry):
            for version_entry in _plain_entries(model_entry.path, f"{model}/", report):
                version = version_entry.name
                if _is_plain_dir(version_entry):
                    listing = _version_listing(version_entry, model, report)
                elif version_entry.is_symlink() and version in disk.version_names(model):
                    _plain_entries(version_entry.path, f"{model}/{version}/", report)
                    listing = _slow_listing(model, version)
                else:
                    continue
                if listing is not None:
                    found[(model, version)] = listing
        elif model_entry.is_symlink() and model in disk.model_names():
            _plain_entries(model_entry.path, f"{model}/", report)
            for version in disk.version_names(model):
                _plain_entries(os.path.join(model_entry.path, version), f"{model}/{version}/", report)
                listing = _slow_listing(model, version)
                if listing is not None:
                    found[(model, version)] = listing
    return found


# --- the index: one read, then only the differences written -------------------------

# name -> (file id, bytes, mtime_ns, hashed)
IndexedFiles = dict[str, tuple[int, int, int, bool]]


def read_index(only: tuple[str, str] | None = None) -> dict[tuple[str, str], tuple[int, IndexedFiles]]:
    """(model, version) -> (version id, its files), in one query; `only` one version."""
    index: dict[tuple[str, str], tuple[int, IndexedFiles]] = {}
    versions = MirrorVersion.objects.order_by()
    if only is not None:
        versions = versions.filter(model=only[0], version=only[1])
    rows = versions.values_list(
        "pk", "model", "version", "files__pk", "files__name", "files__bytes", "files__mtime_ns", "files__sha256"
    )
    for version_id, model, version, file_id, name, size, mtime_ns, sha256 in rows.iterator(chunk_size=2000):
        entry = index.get((model, version))
        if entry is None:
            entry = index[(model, version)] = (version_id, {})
        if file_id is not None:
            entry[1][name] = (file_id, size, mtime_ns, bool(sha256))
    return index


def scan_mirror() -> ScanReport:
    """Make MirrorVersion and MirrorFile match what is on disk now."""
    try:
        report = _scan()
    except IntegrityError:
        # Another scan (the beat and the admin's button) added the same version a
        # moment earlier; a second look finds it in the index.
        report = _scan()
    for sentence in report.skipped:
        log.warning("mirror scan: %s", sentence)
    # What the weights of each version added or changed say about themselves.
    headers.read_changed(report)
    return report


# --- one version, now: what the byte listener does before it answers a manifest -------


def index_version(model: str, version: str) -> ScanReport:
    """Make the index of one version match its directory now, as a scan would (issue 21).

    The byte listener calls it before a manifest, so the hashes it gives are for
    the files as they are at that moment, not as the last scan found them.
    """
    try:
        return _scan(only=(model, version))
    except IntegrityError:
        return _scan(only=(model, version))


@dataclass
class _Changes:
    """The rows one scan writes, gathered to be written in one transaction."""

    new_versions: list[MirrorVersion] = field(default_factory=list)
    new_files: list[MirrorFile] = field(default_factory=list)
    changed_files: list[MirrorFile] = field(default_factory=list)
    gone_files: list[int] = field(default_factory=list)
    touched_versions: list[int] = field(default_factory=list)
    # Ids to hash, in the order of the walk; a new file's id is known once it is written.
    to_hash: list[int | MirrorFile] = field(default_factory=list)


def _scan(only: tuple[str, str] | None = None) -> ScanReport:
    report = ScanReport()
    now = timezone.now()
    if only is None:
        on_disk = walk(report)
    else:
        listing = _slow_listing(*only)
        on_disk = {} if listing is None else {only: listing}
    index = read_index(only)

    changes = _Changes()
    for (model, version), listing in on_disk.items():
        indexed = index.get((model, version))
        if indexed is None:
            row = MirrorVersion(model=model, version=version, scanned_at=now)
            changes.new_versions.append(row)
            report.added.append(str(row))
            for name, (size, mtime_ns) in listing.items():
                new = MirrorFile(version=row, name=name, bytes=size, mtime_ns=mtime_ns)
                changes.new_files.append(new)
                changes.to_hash.append(new)
            continue
        _compare(changes, report, f"{model}/{version}", indexed, listing)

    gone_versions = sorted((key, indexed[0]) for key, indexed in index.items() if key not in on_disk)
    report.removed = [f"{model}/{version}" for (model, version), _ in gone_versions]
    _write(changes, [version_id for _, version_id in gone_versions], now)
    report.to_hash = [item if isinstance(item, int) else item.pk for item in changes.to_hash]
    return report


def _compare(changes: _Changes, report: ScanReport, where: str, indexed, listing: dict) -> None:
    """A version the index has, against its files on disk: what was removed, added or changed."""
    version_id, files = indexed
    touched = False
    for gone in sorted(set(files) - set(listing)):
        changes.gone_files.append(files[gone][0])
        report.changed.append(f"{where}/{gone} removed")
        touched = True
    for name, (size, mtime_ns) in listing.items():
        existing = files.get(name)
        if existing is None:
            new = MirrorFile(version_id=version_id, name=name, bytes=size, mtime_ns=mtime_ns)
            changes.new_files.append(new)
            changes.to_hash.append(new)
            report.changed.append(f"{where}/{name} added")
            touched = True
        elif existing[1] != size or existing[2] != mtime_ns:
            changes.changed_files.append(
                MirrorFile(pk=existing[0], bytes=size, mtime_ns=mtime_ns, sha256="", hashed_at=None)
            )
            changes.to_hash.append(existing[0])
            report.changed.append(f"{where}/{name} changed")
            touched = True
        elif not existing[3]:
            changes.to_hash.append(existing[0])
    if touched:
        changes.touched_versions.append(version_id)


def _write(changes: _Changes, gone_versions: list[int], now) -> None:
    """Write a scan's changes to the index in one transaction, when there are any."""
    c = changes
    if not (c.new_versions or c.new_files or c.changed_files or c.gone_files or c.touched_versions or gone_versions):
        return
    with transaction.atomic():
        MirrorVersion.objects.bulk_create(c.new_versions, batch_size=BATCH)
        MirrorFile.objects.bulk_create(c.new_files, batch_size=BATCH)
        MirrorFile.objects.bulk_update(c.changed_files, ["bytes", "mtime_ns", "sha256", "hashed_at"], batch_size=BATCH)
        for ids in _batches(c.gone_files):
            MirrorFile.objects.filter(pk__in=ids).delete()
        for ids in _batches(c.touched_versions):
            MirrorVersion.objects.filter(pk__in=ids).update(scanned_at=now)
        for ids in _batches(gone_versions):
            MirrorVersion.objects.filter(pk__in=ids).delete()


def _batches(ids: list[int]):
    for start in range(0, len(ids), BATCH):
        yield ids[start : start + BATCH]


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
