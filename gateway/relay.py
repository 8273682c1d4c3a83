"""Passing a replica's answer on: chunk by chunk as it arrives, noting the usage on the way.

The gateway asks streaming replicas for a usage chunk (OpenAI's
`stream_options.include_usage`) so every answer can be counted. A client that
did not ask for that chunk does not get it: many clients read `choices[0]` of
every chunk, and the usage-only chunk has no choices.

A request in another API (translation.py) is passed on the same way, its events
written by its translation's stream; only a whole (not streamed) translated answer
is read first, to be translated in one piece.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import aiohttp
from django.conf import settings

from .errors import ClientGone, Refusal, error_body, replica_error_body
from .events import EventFilter, without_cache_counts
from .intake import sentence_of

if TYPE_CHECKING:
    from .request import Request
    from .usage import Answer

log = logging.getLogger("llmgw.gateway")

# What a relay awaits before the last of an answer: its counting (gateway/forward.py).
Counts = Callable[[], Awaitable[None]]

STREAM_HEADERS = [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]


async def relay(
    request: Request, response: aiohttp.ClientResponse, replica: int, gateway_s: float, answer: Answer, count: Counts
):
    """Pass the replica's answer on as it comes, noting in `answer` what usage needs; `count` (its counting)
    awaited before the client can have the last of it: before the chunk that completes a body of a stated length or
    brings a stream's [DONE], else before the end, so that a client's next request finds its last answer counted."""
    answered_at = time.perf_counter()
    content_type = response.headers.get("Content-Type", "application/json")
    event_stream = content_type.startswith("text/event-stream")
    answer.event_stream = event_stream
    if request.translation is not None and not (response.status == 200 and event_stream):
        answer.event_stream = False  # read as one chat completion (or an error), whatever it said it was
        await _relay_whole_translated(request, response, replica, gateway_s, answer, count)
        return
    send, hang_up = request.send, request.hang_up
    events, whole, headers = _passed_on_as(request, response, content_type, event_stream)
    headers.append((b"x-llmgw-replica", str(replica).encode()))
    headers.append(timing(gateway_s + time.perf_counter() - answered_at))

    # A client that leaves while the answer streams cancels this, which closes the replica's connection.
    hang_up.guard()
    try:
        await send({"type": "http.response.start", "status": response.status, "headers": headers})
        length = None if event_stream else response.content_length
        async for chunk in response.content.iter_any():
            answer.feed(chunk)
            if answer.complete(length):
                await count()
            if events is not None:
                chunk = events.feed(chunk)
                if not chunk:
                    continue
            elif whole is not None:
                whole.append(chunk)
                continue
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        last = _rest(events, whole)
        await count()
        hang_up.unguard()
        await send({"type": "http.response.body", "body": last})
    except asyncio.CancelledError:
        if not hang_up.client_left():
            raise
        # The client went away: the answer so far is counted, the replica's connection closed.
        answer.client_left = True
        return
    except aiohttp.ClientError as error:
        # The replica broke off or fell silent mid-answer: too late for another replica.
        log.warning("replica %s broke off its answer: %s", replica, sentence_of(error))
        if events is None:
            # A body of a stated length cannot be ended as if whole: the connection is cut.
            raise ClientGone from None
        # An event stream ends with an error event of its own format, so the client reads an
        # error rather than a broken transfer.
        hang_up.unguard()
        await send({"type": "http.response.body", "body": events.fail(broke_off(replica, error), "replica_broke_off")})
    finally:
        hang_up.unguard()


def _rest(events: EventFilter | None, whole: list[bytes] | None) -> bytes:
    """What is left to send once all of the replica's answer has come."""
    if events is not None:
        return events.rest()
    return without_cache_counts(b"".join(whole)) if whole is not None else b""


def _passed_on_as(
    request: Request, response: aiohttp.ClientResponse, content_type: str, event_stream: bool
) -> tuple[EventFilter | None, list[bytes] | None, list[tuple[bytes, bytes]]]:
    """Its event filter (a stream, or a translation's stream), the list a whole answer is gathered in (when its
    cache counts are taken out), and its headers."""
    if request.translation is not None:
        return request.translation.stream(), None, [(b"content-type", b"text/event-stream"), *STREAM_HEADERS]
    hide_cache = not settings.GATEWAY_SHOW_CACHED_TOKENS
    events = EventFilter(not request.client_wants_usage, hide_cache) if event_stream else None
    # A whole answer is passed on whole when what it says of the cache is taken out: a count split
    # between two chunks would be missed. Its length stays (without_cache_counts).
    whole = [] if events is None and hide_cache else None
    headers = [(b"content-type", content_type.encode("latin-1"))]
    if event_stream:
        headers += STREAM_HEADERS
    elif (length := response.headers.get("Content-Length")) is not None:
        headers.append((b"content-length", length.encode("latin-1")))
    return events, whole, headers


async def _relay_whole_translated(
    request: Request, response, replica: int, gateway_s: float, answer: Answer, count: Counts
):
    """A translated request's answer that is not a stream: read whole, then translated (or its error put in shape)."""
    answered_at = time.perf_counter()
    translation, dialect = request.translation, request.dialect
    request.hang_up.guard()
    try:
        raw = await response.read()
    except asyncio.CancelledError:
        if not request.hang_up.client_left():
            raise
        answer.client_left = True
        return
    except aiohttp.ClientError as error:
        log.warning("replica %s broke off its answer: %s", replica, sentence_of(error))
        # Nothing was sent yet: a 502 in the client's shape.
        raise Refusal(502, broke_off(replica, error), kind="api_error", code="replica_broke_off") from None
    finally:
        request.hang_up.unguard()
    answer.feed(raw)
    status = response.status
    if status == 200:
        try:
            body = json.dumps(translation.answer(json.loads(raw))).encode()
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as error:
            status = 502
            message = f"The replica's answer was not a chat completion: {sentence_of(error)}."
            body = error_body(dialect, status, message, "api_error", "bad_replica_answer")
    else:
        body = replica_error_body(dialect, status, raw)
    headers = [
        (b"x-llmgw-replica", str(replica).encode()),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        timing(gateway_s + time.perf_counter() - answered_at),
    ]
    await count()
    await request.send({"type": "http.response.start", "status": status, "headers": headers})
    await request.send({"type": "http.response.body", "body": body})


def broke_off(replica: int, error: Exception) -> str:
    """What a client is told of a replica that stopped in the middle of its answer."""
    return f"Replica {replica} stopped in the middle of this answer ({sentence_of(error)}); the answer is incomplete."


def timing(seconds: float) -> tuple[bytes, bytes]:
    """The Server-Timing header with the time the gateway itself added."""
    return b"server-timing", f"gateway;dur={seconds * 1000:.3f}".encode()
