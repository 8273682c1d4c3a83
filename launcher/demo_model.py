"""A tiny llama-architecture GGUF, split into three files, that llama.cpp loads and runs.

Real weights cannot be downloaded here and would be gigabytes; what the tests need,
and what a newcomer needs to see llmgw answer, is a model llama.cpp accepts as a
llama and generates tokens from. The weights are random (seeded, so every run
writes the same bytes), the vocabulary is the 256 bytes plus three specials, so any
text tokenizes by byte fallback and nothing needs a trained tokenizer. It answers
with random text.

`make run` puts it into the mirror as `tiny-demo/v1/` (`seed_mirror`); the tests
write it wherever they need it (`write_tiny_llama`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from contracts.tiny_gguf import EOS_TOKEN_ID, write_llama

__all__ = ["EOS_TOKEN_ID", "seed_mirror", "write_tiny_llama"]

from mirror import disk


def write_tiny_llama(directory: Path, name: str = "tiny", files: int = 3) -> list[Path]:
    """Write the model into `directory` as `files` parts; returns them sorted by name.

    The writer is contracts.tiny_gguf's, which the agent's engine self-test uses too.
    """
    return write_llama(Path(directory) / f"{name}.gguf", name, seed=1234, files=files)


DEMO_MODEL = "tiny-demo"
DEMO_VERSION = "v1"


def seed_mirror(mirror_root: Path) -> Path | None:
    """Put the demo model at `mirror_root/tiny-demo/v1/` unless `tiny-demo` is there already.

    Returns the version's directory when it was written now, None when anything
    of that name was already there: an operator may have replaced or removed
    files in it, and it is theirs from then on.

    Written into a hidden directory and renamed into place, so that a scan or a
    node fetching never sees a version with only some of its three parts: the scan
    and the byte listener ignore hidden names, and the rename is one step.
    """
    target = mirror_root / DEMO_MODEL
    if target.exists() or target.is_symlink():
        return None
    staging = mirror_root / f".{DEMO_MODEL}.tmp"
    # Left over from a start that was stopped halfway; it is ours and never shown.
    shutil.rmtree(staging, ignore_errors=True)
    try:
        write_tiny_llama(staging / DEMO_VERSION)
        # Whole when it appears: not held back as "still being written" (docs/mirror.md).
        disk.mark_settled(staging)
        try:
            staging.rename(target)
        except OSError:
            # Something of that name appeared while we wrote, with files in it.
            return None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target / DEMO_VERSION


if __name__ == "__main__":
    import sys

    for path in write_tiny_llama(Path(sys.argv[1])):
        print(path, path.stat().st_size)
