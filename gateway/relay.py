"""Passing a replica's answer on: chunk by chunk as it arrives, noting the usage on the way.

The gateway asks streaming replicas for a usage chunk (OpenAI's
`stream_options.include_usage`) so every answer can be counted. A client that
did not ask for that chunk does not get it: many clients read `choices[0]` of
every chunk, and the usage-only chunk has no choices.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from typing import TYPE_CHECKING

import aiohttp

from .errors import ClientGone
from .intake import sentence_of

if TYPE_CHECKING:
    from .usage import Answer

log = logging.getLogger("llmgw.gateway")

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
    """Splits a stream into whole events and drops usage-only ones; holds back a partial event.

    With drop_usage False it only splits: a stream the replica breaks off mid-event must
    not leave half an event before the error event that ends it.
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


async def relay(
    receive, send, response, replica: int, gateway_s: float, client_wants_usage: bool, answer: Answer
) -> None:
    """Pass the replica's answer on as it comes, noting in `answer` what usage needs."""
    answered_at = time.perf_counter()
    content_type = response.headers.get("Content-Type", "application/json")
    event_stream = content_type.startswith("text/event-stream")
    answer.event_stream = event_stream
    events = EventFilter(drop_usage=not client_wants_usage) if event_stream else None
    headers = [(b"content-type", content_type.encode("latin-1"))]
    if event_stream:
        headers += [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
    elif (length := response.headers.get("Content-Length")) is not None:
        headers.append((b"content-length", length.encode("latin-1")))
    headers.append((b"x-llmgw-replica", str(replica).encode()))
    headers.append(timing(gateway_s + time.perf_counter() - answered_at))

    # Watch for the client leaving while the answer streams, and stop then.
    hang_up = HangUp(receive)
    try:
        await send({"type": "http.response.start", "status": response.status, "headers": headers})
        async for chunk in response.content.iter_any():
            answer.feed(chunk)
            if events is not None:
                chunk = events.feed(chunk)
                if not chunk:
                    continue
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        last = events.rest() if events is not None else b""
        hang_up.finished = True
        await send({"type": "http.response.body", "body": last})
    except asyncio.CancelledError:
        if not hang_up.client_left():
            raise
        # The client went away: the answer so far is counted, the replica's connection closed.
        return
    except aiohttp.ClientError as error:
        # The replica broke off or fell silent mid-answer: too late for another replica.
        log.warning("replica %s broke off its answer: %s", replica, sentence_of(error))
        if not event_stream:
            # A body of a stated length cannot be ended as if whole: the connection is cut.
            raise ClientGone from None
        # An event stream ends with an error event and [DONE], the half event before it left out,
        # so the client reads an error rather than a broken transfer.
        hang_up.finished = True
        await send({"type": "http.response.body", "body": broke_off(replica, error)})
    finally:
        hang_up.close()


def broke_off(replica: int, error: Exception) -> bytes:
    """The end of an OpenAI event stream whose replica stopped in the middle of it."""
    message = (
        f"Replica {replica} stopped in the middle of this answer ({sentence_of(error)}); the answer is incomplete."
    )
    error_object = {"message": message, "type": "api_error", "param": None, "code": "replica_broke_off"}
    return b"data: " + json.dumps({"error": error_object}).encode() + b"\n\ndata: [DONE]\n\n"


def timing(seconds: float) -> tuple[bytes, bytes]:
    """The Server-Timing header with the time the gateway itself added."""
    return b"server-timing", f"gateway;dur={seconds * 1000:.3f}".encode()


class HangUp:
    """Cancels the task answering a client when the client leaves before `finished` is set.

    Closing the replica's connection (what the cancel does) is what makes the engine stop
    generating. Used by relay() and translation.relay_translated().
    """

    def __init__(self, receive) -> None:
        self.finished = False
        task = asyncio.current_task()

        async def watch() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    if not self.finished:
                        task.cancel()
                    return

        self._watcher = asyncio.get_running_loop().create_task(watch())

    def client_left(self) -> bool:
        """In `except CancelledError`: whether the client's leaving caused it (then uncancelled)."""
        if self.finished or not self._watcher.done():
            return False
        asyncio.current_task().uncancel()
        return True

    def close(self) -> None:
        self._watcher.cancel()
