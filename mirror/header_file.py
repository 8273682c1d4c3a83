"""A weights file opened for its header: plain reads within its size, and the sentences of a refusal.

A leaf of `mirror/header_reader.py`, which loads it by its path when it runs as a process
of its own (`python -I -S`, the standard library only, its folder not on sys.path): so
this module too is the standard library only, and imports nothing of the mirror's.

Files are read with plain reads, never mapped: a file replaced or cut short while it is
read gives a short read and a sentence (mapped, it was a SIGBUS), and a file whose size
or modification time moved while it was read says so.
"""

from __future__ import annotations

import math
import os
import stat
import struct

# A name a header gives (architecture, dtype): this long at most, printable.
MAX_NAME = 64
# A GGUF key this long at most (real ones are a few tens of bytes).
MAX_KEY_BYTES = 256
# Array elements walked one by one (strings, arrays in arrays) in one file, all arrays together.
MAX_WALKED = 8_000_000


class Refused(ValueError):
    """A header not read; the message says why, in words staff read."""


def name_problem(value, what: str) -> str:
    """Why `value` is not a name a header may give (a short printable string), or ""."""
    if not isinstance(value, str):
        return f"{what} is not a string"
    if len(value) > MAX_NAME:
        return f"{what} is {len(value):,} characters long (llmgw keeps names of at most {MAX_NAME})"
    if any(ch < " " or ch == "\x7f" for ch in value):
        return f"{what} holds a control character ({value!r})"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        # A lone surrogate, from a JSON escape: PostgreSQL's jsonb refuses it.
        return f"{what} is not valid Unicode ({value!r})"
    return ""


def number_problem(value, what: str, limit: int) -> str:
    """Why `value` is not a whole number from 0 to `limit`, or "" when it is one."""
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and not math.isfinite(value):
            return f"{what} is {value}, not a whole number"
        return f"{what} is a {type(value).__name__}, not a whole number"
    if not 0 <= value <= limit:
        return f"{what} is {value:,}, outside 0 to {limit:,}"
    return ""


class File:
    """A weights file opened for plain reads, with where it is and how much of it there is."""

    def __init__(self, path: str, name: str, expected: tuple[int, int]):
        self.name = name
        # Not blocking on a FIFO swapped in for the file: it is refused below, not waited on.
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as error:
            raise Refused(f"{name} cannot be read: {error.strerror or error}") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise Refused(f"{name} is not a regular file")
        os.set_blocking(fd, True)
        self.f = os.fdopen(fd, "rb", buffering=1 << 16)
        self.size = st.st_size
        self.before = (st.st_size, st.st_mtime_ns, st.st_ino)
        self.path = path
        self.at = 0
        self.walked = 0
        if (st.st_size, st.st_mtime_ns) != tuple(expected):
            self.close()
            raise Refused(f"{name} changed since the scan listed it: it is read again once it has settled")

    def close(self) -> None:
        self.f.close()

    def changed(self) -> str:
        """A sentence when the file moved while it was read (written to, cut short, replaced), else ""."""
        st = os.fstat(self.f.fileno())
        try:
            now = os.stat(self.path)
        except OSError:
            now = None
        if (st.st_size, st.st_mtime_ns, st.st_ino) != self.before or now is None or now.st_ino != st.st_ino:
            return (
                f"{self.name} changed while its header was read (written to or replaced): "
                "it is read again at the scan after it has settled"
            )
        return ""

    def read(self, n: int) -> bytes:
        raw = self.f.read(n)
        if len(raw) != n:
            raise Refused("the file ends inside its header")
        self.at += n
        return raw

    def take(self, fmt: str):
        return struct.unpack("<" + fmt, self.read(struct.calcsize("<" + fmt)))[0]

    def skip(self, n: int) -> None:
        if n < 0 or self.at + n > self.size:
            raise Refused(f"the file ends inside a value of {n:,} bytes")
        self.f.seek(n, os.SEEK_CUR)
        self.at += n

    def walk(self) -> None:
        self.walked += 1
        if self.walked > MAX_WALKED:
            raise Refused(f"its arrays hold more than {MAX_WALKED:,} values in all")

    def key(self) -> str:
        n = self.take("Q")
        if n > MAX_KEY_BYTES:
            raise Refused(f"a key of {n:,} bytes (llmgw reads keys of at most {MAX_KEY_BYTES})")
        raw = self.read(n)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise Refused(f"a key that is not UTF-8 ({raw[:40]!r})") from None

    def text(self, what: str) -> str:
        n = self.take("Q")
        if n > MAX_NAME * 4:
            raise Refused(f"{what} is {n:,} bytes long (llmgw keeps names of at most {MAX_NAME} characters)")
        try:
            value = self.read(n).decode("utf-8")
        except UnicodeDecodeError:
            raise Refused(f"{what} is not UTF-8") from None
        if problem := name_problem(value, what):
            raise Refused(problem)
        return value
