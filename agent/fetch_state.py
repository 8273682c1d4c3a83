"""What a fetch keeps under the cache's `.fetch` directory: a lock per target, a validator per part.

Never beside the weights: a set's directory is handed to an engine as it is.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from .progress import Progress
from .sources import FetchError

STATE_DIR = ".fetch"


@contextmanager
def locked(cache: Path, target: Path, progress: Progress, cancel: threading.Event | None = None):
    """Hold the lock of one target (a file or a set) against every other fetch on this host.

    flock on a file under the cache: two tasks, two processes or two threads
    fetching the same thing take turns, and the second finds the work done.
    The kernel drops the lock when a process dies, so a SIGKILL never leaves it held.
    """
    state = Path(cache) / STATE_DIR
    state.mkdir(parents=True, exist_ok=True)
    fd = os.open(state / f"{_key(target)}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if cancel is not None and cancel.is_set():
                    raise FetchError("stopped") from None
                # Polled rather than blocking, so a cancel reaches a waiting fetch.
                progress.waiting()
                time.sleep(0.2)
        yield
    finally:
        os.close(fd)


def _key(target: Path) -> str:
    # From the real path: a fetch given the cache as a relative path or through a
    # symlink must take the same lock as one given it any other way.
    return hashlib.sha256(os.path.realpath(target).encode()).hexdigest()[:32]


def _validator_path(cache: Path, target: Path) -> Path:
    return Path(cache) / STATE_DIR / f"{_key(target)}.json"


def read_validator(cache: Path, target: Path) -> dict:
    """What the file a part was started from was (ETag, Last-Modified, size); {} when unknown."""
    try:
        return json.loads(_validator_path(cache, target).read_text())
    except (OSError, ValueError):
        return {}


def write_validator(cache: Path, target: Path, etag: str, last_modified: str, total: int | None) -> None:
    _validator_path(cache, target).write_text(
        json.dumps({"etag": etag, "last_modified": last_modified, "total": total})
    )


# --- what was verified: so a cached set is checked against its manifest without re-hashing it ---

# name -> (bytes, mtime_ns, sha256): each file of a set (or a single file) as it was when its
# sha256 was found to agree with the mirror's, with the local size and mtime it had then.
Verified = dict[str, tuple[int, int, str]]


def _verified_path(cache: Path, target: Path) -> Path:
    return Path(cache) / STATE_DIR / f"{_key(target)}.verified.json"


def read_verified(cache: Path, target: Path) -> Verified:
    """What was verified of `target` (a set's directory or one file); {} when nothing was (a set from before)."""
    try:
        raw = json.loads(_verified_path(cache, target).read_text())
        return {name: (int(b), int(m), str(h)) for name, (b, m, h) in raw.items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}


def write_verified(cache: Path, target: Path, verified: Verified) -> None:
    path = _verified_path(cache, target)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({name: list(v) for name, v in verified.items()}))
    os.replace(tmp, path)


def still_verified(path: Path, recorded: tuple[int, int, str] | None, size: int, sha256: str) -> bool:
    """Whether the file at `path` is the one verified as (size, sha256), by its size and mtime alone."""
    if recorded is None or not sha256 or recorded[0] != size or recorded[2] != sha256:
        return False
    try:
        st = path.stat()
    except OSError:
        return False
    return (st.st_size, st.st_mtime_ns) == (recorded[0], recorded[1])
