"""Other clients' APIs over chat completions: what Anthropic Messages and OpenAI Responses share.

Every engine the fleet runs speaks chat completions; `/v1/messages` and
`/v1/responses` are translated to it on the way in and back on the way out
(messages.py, responses.py). A translation is made per request from the client's
body: `.chat` is the chat-completions body sent to the replica, `.answer()` turns
a whole chat completion into the client's answer, `.stream()` gives a translator
fed the replica's event stream, and `.error()` puts a replica's refusal in the
client's shape.

The replica's own bytes are still what usage is counted from, so a translated
answer is counted exactly as a chat completion is.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import aiohttp

from .errors import Refusal
from .intake import sentence_of
from .relay import HangUp, complete_events, timing
from .usage import Answer

log = logging.getLogger("llmgw.gateway")


class Translation:
    """One request's translation; the two APIs fill these in."""

    chat: dict

    def answer(self, completion: dict) -> dict:
        raise NotImplementedError

    def stream(self) -> ChatStream:
        raise NotImplementedError

    def error(self, status: int, body: bytes) -> bytes:
        """A replica's refusal (status and body as it sent them) in the client's shape."""
        raise NotImplementedError


def sse(event: str, data: dict) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + json.dumps(data).encode() + b"\n\n"


class ChatStream:
    """Reads a chat-completions event stream chunk by chunk and writes the client's events.

    `.chunk(dict)` and `.finish()` return the client's events for one chat chunk and
    for the end; `.failed(dict)` for an error the engine sent in the stream.
    """

    def __init__(self) -> None:
        self.pending = b""
        self.finished = False

    def feed(self, data: bytes) -> bytes:
        self.pending += data
        end = complete_events(self.pending)
        if not end:
            return b""
        events, self.pending = self.pending[:end], self.pending[end:]
        return self._events(events)

    def rest(self) -> bytes:
        """The last events; an engine that closed without `[DONE]` still ends the client's stream."""
        out = self._events(self.pending)
        self.pending = b""
        if not self.finished:
            self.finished = True
            out += self.finish()
        return out

    def _events(self, events: bytes) -> bytes:
        out = []
        for line in events.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                if not self.finished:
                    self.finished = True
                    out.append(self.finish())
            elif data and not self.finished:
                chunk = json.loads(data)
                out.append(self.failed(chunk) if "error" in chunk else self.chunk(chunk))
        return b"".join(out)

    def chunk(self, chunk: dict) -> bytes:
        raise NotImplementedError

    def finish(self) -> bytes:
        raise NotImplementedError

    def failed(self, chunk: dict) -> bytes:
        raise NotImplementedError


def engine_message(body: bytes) -> str:
    """The sentence in an engine's error body (OpenAI's shape, or FastAPI's `detail`), or the body."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace").strip()[:2000] or "the replica refused the request"
    if isinstance(parsed, dict):
        error = parsed.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
        if parsed.get("detail"):
            return str(parsed["detail"])
    return json.dumps(parsed)[:2000]


def text_of(content, where: str) -> str:
    """The text of content given as a string or as a list of text blocks."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for block in content:
            if isinstance(block, dict) and isinstance(block.get("text"), str):
                parts.append(block["text"])
            else:
                kind = block.get("type") if isinstance(block, dict) else type(block).__name__
                raise Refusal(400, f"{where} may hold only text here; it has a block of type {kind!r}.")
        return "".join(parts)
    raise Refusal(400, f"{where} must be a string or a list of text blocks.")


async def relay_translated(
    translation: Translation,
    receive,
    send,
    response: aiohttp.ClientResponse,
    replica: int,
    gateway_s: float,
    answer: Answer,
) -> None:
    """relay() for a translated request: the replica's answer in the client's shape.

    The replica's own bytes (a chat completion) go to `answer`, as relay()'s do, for its usage.
    """
    answered_at = time.perf_counter()
    content_type = response.headers.get("Content-Type", "application/json")
    streaming = response.status == 200 and content_type.startswith("text/event-stream")
    answer.event_stream = streaming
    status = response.status
    headers = [(b"x-llmgw-replica", str(replica).encode())]
    if streaming:
        headers += [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        headers.append((b"x-accel-buffering", b"no"))

    # As in relay(): a client that leaves stops the engine.
    hang_up = HangUp(receive)
    try:
        if not streaming:
            raw = await response.read()
            answer.feed(raw)
            if status == 200:
                try:
                    body = json.dumps(translation.answer(json.loads(raw))).encode()
                except (ValueError, KeyError, IndexError, TypeError, AttributeError) as error:
                    status, body = (
                        502,
                        translation.error(
                            502, f"The replica's answer was not a chat completion: {sentence_of(error)}.".encode()
                        ),
                    )
            else:
                body = translation.error(status, raw)
            headers.append((b"content-type", b"application/json"))
            headers.append((b"content-length", str(len(body)).encode()))
            headers.append(timing(gateway_s + time.perf_counter() - answered_at))
            hang_up.finished = True
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        events = translation.stream()
        headers.append(timing(gateway_s + time.perf_counter() - answered_at))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        async for chunk in response.content.iter_any():
            answer.feed(chunk)
            out = events.feed(chunk)
            if out:
                await send({"type": "http.response.body", "body": out, "more_body": True})
        last = events.rest()
        hang_up.finished = True
        await send({"type": "http.response.body", "body": last})
    except asyncio.CancelledError:
        if not hang_up.client_left():
            raise
        # The client went away: the answer so far is counted, the replica's connection closed.
        return
    except aiohttp.ClientError as error:
        log.warning("replica %s broke off its answer: %s", replica, sentence_of(error))
        message = (
            f"Replica {replica} stopped in the middle of this answer ({sentence_of(error)}); the answer is incomplete."
        )
        if not streaming:
            # Nothing was sent yet: a 502 in the client's shape.
            raise Refusal(502, message, kind="api_error", code="replica_broke_off") from None
        # The stream ends with the error event of its own format, not a cut connection.
        hang_up.finished = True
        await send({"type": "http.response.body", "body": events.failed({"error": {"message": message}})})
    finally:
        hang_up.close()
