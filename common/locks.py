"""Work two control workers may take at once (two control hosts), done by one: a PostgreSQL advisory lock.

Session-level (pg_try_advisory_lock): held by this process's database connection until the
work ends or the connection closes, so a worker killed mid-task (its host lost) frees it
with its connection, and there is no expiry to guess for work that may take minutes. Needs
a session of its own on the server: a pgbouncer in transaction mode would hand the lock to
whichever client came next (docs/fleet.md, "A second control host").
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager

from django.db import connection


def lock_key(name: str) -> int:
    """The advisory lock's 64-bit key for `name`."""
    return int.from_bytes(hashlib.sha256(f"llmgw:{name}".encode()).digest()[:8], "big", signed=True)


@contextmanager
def only_one(name: str) -> Iterator[bool]:
    """True inside while this process alone does `name` across the control plane; False when another does it now.

    On SQLite (one host, one control worker by `manage.py up`) always True.
    """
    if connection.vendor != "postgresql":
        yield True
        return
    key = lock_key(name)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_lock(%s)", [key])
        held = bool(cursor.fetchone()[0])
    try:
        yield held
    finally:
        if held:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_unlock(%s)", [key])
