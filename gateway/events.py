"""Event streams (server-sent events) as engines write them: split into whole events, filtered, written."""

from __future__ import annotations

import json
import re

from .endpoints import OPENAI
from .errors import error_event

EVENT_END = re.compile(rb"\r?\n\r?\n")
EMPTY_CHOICES = re.compile(rb'"choices"\s*:\s*\[\s*\]')
# What an engine says of its prompt cache: OpenAI's cached_tokens, and llama-server's timings
# (cache_n, and prompt_n, the prompt's tokens less those cached).
CACHE_COUNT = re.compile(rb'("(?:cached_tokens|cache_n)"\s*:\s*)(\d+)')
TIMINGS = re.compile(rb'"timings"\s*:\s*\{[^{}]*\}')


def _zero(match: re.Match) -> bytes:
    return match.group(1) + b"0" + b" " * (len(match.group(2)) - 1)


def _no_timings(match: re.Match) -> bytes:
    return b'"timings":{}' + b" " * (len(match.group(0)) - 12)


def without_cache_counts(data: bytes) -> bytes:
    """An answer less what it says of the engine's prompt cache, the same length (padded with JSON's spaces).

    The cache is the engine's, shared by every key it serves: how much of a prompt it
    had tells one key how much of its guess another key sent (docs/gateway.md). The
    length stays, so a Content-Length stays true.
    """
    if b'"cache' not in data and b'"timings"' not in data:
        return data
    return TIMINGS.sub(_no_timings, CACHE_COUNT.sub(_zero, data))


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

    def __init__(self, drop_usage: bool = True, hide_cache: bool = False) -> None:
        self.pending = b""
        self.drop_usage = drop_usage
        self.hide_cache = hide_cache

    def feed(self, chunk: bytes) -> bytes:
        self.pending += chunk
        end = complete_events(self.pending)
        if not end:
            return b""
        events, self.pending = self.pending[:end], self.pending[end:]
        return self._filtered(events)

    def rest(self) -> bytes:
        rest, self.pending = self.pending, b""
        return self._filtered(rest)

    def _filtered(self, events: bytes) -> bytes:
        if self.drop_usage:
            events = without_usage_only_events(events)
        return without_cache_counts(events) if self.hide_cache else events

    def fail(self, message: str, code: str) -> bytes:
        """The end of a stream that cannot go on: an error event and [DONE], the half event before it left out."""
        self.pending = b""
        return error_event(OPENAI, 502, message, "api_error", code)
