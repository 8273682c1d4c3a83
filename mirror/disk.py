"""What the mirror directory holds, read from disk at the moment of asking.

The directory is the truth: operators copy files in by hand, so every answer
here comes from listing and stat-ing it, never from the index in the database.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings

from contracts.names import plain_name_problem


def root() -> Path:
    return Path(settings.MIRROR_ROOT)


def _real_root() -> Path:
    return Path(os.path.realpath(root()))


def resolve(*names: str) -> Path | None:
    """The path of root/names..., or None when it is not a plain name or leaves the root.

    The real path is checked as well as the names, because a symlink is one
    name that can point anywhere.
    """
    for name in names:
        if plain_name_problem(name) is not None:
            return None
    path = root().joinpath(*names)
    if _servable_depth(path) != len(names):
        return None
    return path


@dataclass(frozen=True)
class DiskFile:
    name: str
    bytes: int
    mtime_ns: int


def _entries(directory: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(directory) as it:
            return sorted(it, key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return []


def model_names() -> list[str]:
    base = resolve()
    if base is None:
        return []
    return [e.name for e in _entries(base) if plain_name_problem(e.name) is None and _is_dir_inside(base / e.name)]


def version_names(model: str) -> list[str]:
    base = resolve(model)
    if base is None:
        return []
    return [e.name for e in _entries(base) if plain_name_problem(e.name) is None and _is_dir_inside(base / e.name)]


def version_files(model: str, version: str) -> list[DiskFile] | None:
    """The files of a version as they are now, or None when there is no such version."""
    base = resolve(model, version)
    if base is None or not base.is_dir():
        return None
    files = []
    for entry in _entries(base):
        if plain_name_problem(entry.name) is not None:
            continue
        st = _stat_inside(base / entry.name)
        if st is None or not stat.S_ISREG(st.st_mode):
            continue
        files.append(DiskFile(entry.name, st.st_size, st.st_mtime_ns))
    return files


def _is_dir_inside(path: Path) -> bool:
    st = _stat_inside(path)
    return st is not None and stat.S_ISDIR(st.st_mode)


def _servable_depth(path: Path) -> int | None:
    """How deep under the root `path` really is, counted by plain names; None when it is not.

    A symlink is one name that can point anywhere, so what it resolves to is checked
    as the mirror would check a name it was given: a link to a hidden file, an
    unfinished download or anything outside the root serves nothing.
    """
    real = Path(os.path.realpath(path))
    try:
        parts = real.relative_to(_real_root()).parts
    except ValueError:
        return None
    if any(plain_name_problem(part) is not None for part in parts):
        return None
    return len(parts)


def _stat_inside(path: Path) -> os.stat_result | None:
    """stat() of what `path` is, when that lies at the same depth under the root, by plain names."""
    if _servable_depth(path) != len(path.relative_to(root()).parts):
        return None
    try:
        return os.stat(path)
    except OSError:
        return None


def mark_settled(staging: Path) -> None:
    """Date the files of a copy staged under a hidden name back past LLMGW_MIRROR_SETTLE_S.

    For a writer that stages a version and renames it into place in one step (the
    demo models): it is whole when it appears, which the mirror can otherwise only
    tell by the clock, and would hold back as "still being written" for a while.
    """
    import time

    then = time.time_ns() - (settings.MIRROR_SETTLE_S + 1) * 10**9
    for path in Path(staging).rglob("*"):
        if path.is_file() and not path.is_symlink():
            os.utime(path, ns=(then, then))
