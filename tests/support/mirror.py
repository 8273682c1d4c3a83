"""A mirror filled by hand."""

from __future__ import annotations

import os
import time
from pathlib import Path


def put(root: Path, model: str, version: str, files: dict[str, bytes], settled: bool = True) -> Path:
    """Copy files into the mirror by hand, the way an operator does.

    `settled`: the copy finished a while ago (its mtime a minute back), so the mirror
    takes the files as whole (LLMGW_MIRROR_SETTLE_S); False for a copy just made.
    """
    directory = root / model / version
    directory.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (directory / name).write_bytes(content)
        if settled:
            then = time.time_ns() - 60 * 10**9
            os.utime(directory / name, ns=(then, then))
    return directory


def settle(*paths: Path) -> None:
    """Files copied in a while ago: dated a minute back, so the mirror takes them as whole (LLMGW_MIRROR_SETTLE_S)."""
    then = time.time_ns() - 60 * 10**9
    for path in paths:
        for file in [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]:
            os.utime(file, ns=(then, then))


def listing(directory: Path) -> list[str]:
    """The names in a directory, sorted."""
    return sorted(p.name for p in directory.iterdir())
