"""Event streams (server-sent events) as engines write them: split into whole events, filtered, written."""

from __future__ import annotations

import json
import re

from .endpoints import OPENAI
from .errors import error_event

EVENT_END = re.compile(rb"\r?\n\r?\n")
EMPTY_CHOICES = re.compile(rb'"choices"\s*:\s*\[\s*\]')


def sse(event: str, data: dict) -> bytes:
    """A named event, as Anthropic's and the Responses API's streams have them."""
    return b"event: " + event.encode() + b"\ndata: " + json.dumps(data).encode() + b"\n\n"


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
    """A chat stream passed on in OpenAI's own format: whole events, less usage-only ones; a partial event held back.

    With drop_usage False it only splits: a stream the replica breaks off mid-event must
    not leave half an event before the error event that ends it. The same three calls
    as a translation's stream (translation.ChatStream), so relay() passes either on.
    """

    def __init__(self, drop_usage: bool = True) -> None:
        self.pending = b""
        self.drop_usage = drop_usage

    def feed(self, chunk: bytes) -> bytes:
        self.pending += chunk
        end = complete_events(self.pending)
        if not end:
            return b""
        events, self.pending = self.pending[:end], self.pending[end:]
        return without_usage_only_events(events) if self.drop_usage else events

    def rest(self) -> bytes:
        rest, self.pending = self.pending, b""
        return without_usage_only_events(rest) if self.drop_usage else rest

    def fail(self, message: str, code: str) -> bytes:
        """The end of a stream that cannot go on: an error event and [DONE], the half event before it left out."""
        self.pending = b""
        return error_event(OPENAI, 502, message, "api_error", code)
