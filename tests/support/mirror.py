"""A mirror filled by hand."""

from __future__ import annotations

from pathlib import Path


def put(root: Path, model: str, version: str, files: dict[str, bytes]) -> Path:
    """Copy files into the mirror by hand, the way an operator does."""
    directory = root / model / version
    directory.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (directory / name).write_bytes(content)
    return directory


def listing(directory: Path) -> list[str]:
    """The names in a directory, sorted."""
    return sorted(p.name for p in directory.iterdir())
