"""Other clients' APIs over chat completions: what Anthropic Messages and OpenAI Responses share.

Every engine the fleet runs speaks chat completions; `/v1/messages` and
`/v1/responses` are translated to it on the way in and back on the way out
(anthropic_messages.py, openai_responses.py). A translation is made per request
from the client's body: `.chat` is the chat-completions body sent to the replica,
`.answer()` turns a whole chat completion into the client's answer, and
`.stream()` gives the walker of the replica's event stream that writes the
client's events (ChatStream, with each API's hooks).

The replica's own bytes are still what usage is counted from, so a translated
answer is counted exactly as a chat completion is.
"""

from __future__ import annotations

import json

from .errors import Refusal, error_event, error_of
from .events import complete_events


class Translation:
    """One request's translation; each API fills these in."""

    chat: dict
    dialect: str  # endpoints.ANTHROPIC or endpoints.RESPONSES: how its errors are written

    def answer(self, completion: dict) -> dict:
        raise NotImplementedError

    def stream(self) -> ChatStream:
        raise NotImplementedError


class ChatStream:
    """Walks a chat-completions event stream and writes the client's events through its API's hooks.

    The walk is the same for every API: the stream is split into whole events, each
    chunk's text goes into a text block, each tool call's deltas into a block of its
    own, and the finish reason and the usage chunk are kept for the end, which comes at
    `[DONE]` or when the engine closes without it. What an API writes is its hooks:

        opening()                 the answer begins (before anything else)
        text_opened()             a text block begins
        text(text)                a piece of text
        tool_opened(id, name)     a tool call begins (id: the engine's, or None)
        tool_arguments(piece)     a piece of its arguments
        closed()                  the open block ends
        ending()                  the answer ends: self.finish_reason, self.last_choice, self.usage
        error(message, code)      an error event that ends the stream (the base class writes it)
    """

    dialect: str

    def __init__(self) -> None:
        self.pending = b""
        self.finished = False
        self.started = False
        self.open_key = None  # the open block: None, "text", or ("tool", the call's index in the chat stream)
        self.finish_reason: str | None = None
        self.last_choice: dict = {}
        self.usage: dict | None = None

    # --- what relay() calls ---------------------------------------------------------

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
            out += self._finish()
        return out

    def fail(self, message: str, code: str) -> bytes:
        """The end of a stream that cannot go on (its replica broke off): an error event."""
        self.finished = True
        return self.error(message, code)

    # --- the walk -------------------------------------------------------------------

    def _events(self, events: bytes) -> bytes:
        out = []
        for line in events.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                if not self.finished:
                    out.append(self._finish())
            elif data and not self.finished:
                chunk = json.loads(data)
                if "error" in chunk:  # the engine's own error, in the stream
                    out.append(self.fail(error_of(data)[0], "engine_error"))
                else:
                    out.append(self._chunk(chunk))
        return b"".join(out)

    def _chunk(self, chunk: dict) -> bytes:
        out = [self._start()] if not self.started else []
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            text = delta.get("content")
            if text:
                if self.open_key != "text":
                    out.append(self._close())
                    self.open_key = "text"
                    out.append(self.text_opened())
                out.append(self.text(text))
            for call in delta.get("tool_calls") or []:
                key = ("tool", call.get("index", 0))
                function = call.get("function") or {}
                if self.open_key != key:
                    out.append(self._close())
                    self.open_key = key
                    out.append(self.tool_opened(call.get("id"), function.get("name") or ""))
                if function.get("arguments"):
                    out.append(self.tool_arguments(function["arguments"]))
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
                self.last_choice = choice
        return b"".join(out)

    def _start(self) -> bytes:
        self.started = True
        return self.opening()

    def _close(self) -> bytes:
        if self.open_key is None:
            return b""
        self.open_key = None
        return self.closed()

    def _finish(self) -> bytes:
        self.finished = True
        out = b"" if self.started else self._start()
        return out + self._close() + self.ending()

    # --- the hooks ------------------------------------------------------------------

    def opening(self) -> bytes:
        raise NotImplementedError

    def text_opened(self) -> bytes:
        raise NotImplementedError

    def text(self, text: str) -> bytes:
        raise NotImplementedError

    def tool_opened(self, call_id: str | None, name: str) -> bytes:
        raise NotImplementedError

    def tool_arguments(self, piece: str) -> bytes:
        raise NotImplementedError

    def closed(self) -> bytes:
        raise NotImplementedError

    def ending(self) -> bytes:
        raise NotImplementedError

    def error(self, message: str, code: str) -> bytes:
        return error_event(self.dialect, 500, message, "api_error", code)


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
