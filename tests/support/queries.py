"""What a test reads of the SQL a block of code ran (django's CaptureQueriesContext)."""

from __future__ import annotations


def writes(queries) -> list[str]:
    """The statements among `queries` that write: INSERT, UPDATE and DELETE."""
    return [q["sql"] for q in queries if q["sql"].split(None, 1)[0].upper() in {"INSERT", "UPDATE", "DELETE"}]
