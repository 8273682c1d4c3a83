"""Passing a replica's answer on: chunk by chunk as it arrives, noting the usage on the way.

The gateway asks streaming replicas for a usage chunk (OpenAI's
`stream_options.include_usage`) so every answer can be counted. A client that
did not ask for that chunk does not get it: many clients read `choices[0]` of
every chunk, and the usage-only chunk has no choices.
"""

from __future__ import annotations

import re

# Enough of an answer's end to hold its usage object; kept while the rest streams past.
TAIL_BYTES = 16384

EVENT_END = re.compile(rb"\r?\n\r?\n")
EMPTY_CHOICES = re.compile(rb'"choices"\s*:\s*\[\s*\]')


def complete_events(pending: bytes) -> int:
    """Where the last complete event in `pending` ends; 0 if none is complete yet."""
    lf, crlf = pending.rfind(b"\n\n"), pending.rfind(b"\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 3 if crlf >= 0 else 0)


def without_usage_only_events(events: bytes) -> bytes:
    """Complete events, less any that carries only usage (no choices)."""
    if b'"usage"' not in events:
        return events
    kept = []
    start = 0
    for match in EVENT_END.finditer(events):
        event = events[start : match.end()]
        start = match.end()
        if b'"usage"' in event and EMPTY_CHOICES.search(event):
            continue
        kept.append(event)
    kept.append(events[start:])
    return b"".join(kept)


class EventFilter:
    """Splits a stream into whole events and drops usage-only ones; holds back a partial event."""

    def __init__(self) -> None:
        self.pending = b""

    def feed(self, chunk: bytes) -> bytes:
        self.pending += chunk
        end = complete_events(self.pending)
        if not end:
            return b""
        events, self.pending = self.pending[:end], self.pending[end:]
        return without_usage_only_events(events)

    def rest(self) -> bytes:
        rest, self.pending = self.pending, b""
        return without_usage_only_events(rest)
