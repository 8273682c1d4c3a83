"""A UNIX socket's address within the kernel's 108 bytes, however deep the directory it lives in.

`bind` and `connect` take at most 107 bytes of path (sun_path). A node's cache may be deeper
than that (a test's temporary directory under a pytest-xdist worker is), so a longer path is
reached through an open descriptor of its directory, `/proc/self/fd/N/NAME`: the same file,
named in a few bytes. The descriptor is open only while the address is used.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

# sun_path's 108 bytes, less the terminating NUL and a margin.
MOST = 100


@contextlib.contextmanager
def reachable(path: Path) -> Iterator[str]:
    """An address for the socket file at `path`: the path itself when short enough."""
    if len(os.fsencode(str(path))) <= MOST:
        yield str(path)
        return
    directory = os.open(Path(path).parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{directory}/{Path(path).name}"
    finally:
        os.close(directory)
