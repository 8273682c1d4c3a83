"""Anthropic's Messages API at `/v1/messages`, translated to and from chat completions.

What Claude-style clients and coding tools send: a system prompt, messages of
content blocks (text, tool_use, tool_result), `max_tokens` (required),
stop sequences, tools. Answers, errors and streamed events are in Anthropic's
shape, so the `anthropic` client reads them as it reads Anthropic's own.
"""

from __future__ import annotations

import json
import uuid

from .errors import Refusal
from .translation import ChatStream, Translation, engine_message, sse, text_of
from .usage import cached_of

# Anthropic's error type for each status the gateway or a replica answers.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
TEXT_DELTA = (
    b'event: content_block_delta\ndata: {"type": "content_block_delta", "index": %d, '
    b'"delta": {"type": "text_delta", "text": %s}}\n\n'
)
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "function_call": "tool_use"}


def error_body(status: int, message: str) -> bytes:
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return json.dumps({"type": "error", "error": {"type": kind, "message": message}}).encode()


class AnthropicRefusal(Refusal):
    """A refusal said in Anthropic's error shape."""

    @classmethod
    def of(cls, refusal: Refusal) -> AnthropicRefusal:
        return cls(refusal.status, refusal.message, refusal.kind, refusal.code, refusal.param, refusal.headers)

    def body(self) -> bytes:
        return error_body(self.status, self.message)


def _tool_call(block: dict) -> dict:
    arguments = block.get("input", {})
    return {
        "id": str(block.get("id", "")),
        "type": "function",
        "function": {"name": str(block.get("name", "")), "arguments": json.dumps(arguments)},
    }


def _messages(request: dict) -> list[dict]:
    chat = []
    system = request.get("system")
    if system:
        chat.append({"role": "system", "content": text_of(system, '"system"')})
    messages = request.get("messages")
    if not isinstance(messages, list) or not messages:
        raise Refusal(400, '"messages" must be a list of at least one message.', param="messages")
    for n, message in enumerate(messages):
        where = f"messages[{n}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise Refusal(400, f'{where} must be an object with "role" "user" or "assistant".')
        role, content = message["role"], message.get("content")
        if isinstance(content, str):
            chat.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise Refusal(400, f"{where}.content must be a string or a list of content blocks.")
        texts, calls = [], []
        for block in content:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                texts.append(str(block.get("text", "")))
            elif kind == "tool_use" and role == "assistant":
                calls.append(_tool_call(block))
            elif kind == "tool_result" and role == "user":
                # Chat completions wants each result as a tool message right after the call.
                result = text_of(block.get("content"), f"{where}'s tool_result content")
                if block.get("is_error"):
                    result = f"Error: {result}"
                chat.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")), "content": result})
            elif kind in ("thinking", "redacted_thinking"):
                continue
            else:
                raise Refusal(400, f"{where} has a content block of type {kind!r}, which this gateway does not take.")
        if role == "assistant":
            entry = {"role": "assistant", "content": "".join(texts) or None}
            if calls:
                entry["tool_calls"] = calls
            chat.append(entry)
        elif texts:
            chat.append({"role": "user", "content": "".join(texts)})
    return chat


def _tools(request: dict) -> dict:
    out = {}
    tools = request.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise Refusal(400, '"tools" must be a list.', param="tools")
        out["tools"] = []
        for tool in tools:
            if not isinstance(tool, dict) or not tool.get("name"):
                raise Refusal(400, 'Each of "tools" needs a "name" and an "input_schema".', param="tools")
            function = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
            if tool.get("description"):
                function["description"] = tool["description"]
            out["tools"].append({"type": "function", "function": function})
    choice = request.get("tool_choice")
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind == "auto":
            out["tool_choice"] = "auto"
        elif kind == "any":
            out["tool_choice"] = "required"
        elif kind == "none":
            out["tool_choice"] = "none"
        elif kind == "tool":
            out["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
        else:
            raise Refusal(400, f'"tool_choice" of type {kind!r} is not one of auto, any, tool, none.')
        if choice.get("disable_parallel_tool_use"):
            out["parallel_tool_calls"] = False
    return out


class Messages(Translation):
    def __init__(self, request: dict) -> None:
        self.model = request["model"]
        wanted = request.get("max_tokens")
        if wanted is None:
            raise Refusal(400, '"max_tokens" is required: the most tokens the answer may have.', param="max_tokens")
        chat = {"model": self.model, "messages": _messages(request), "max_tokens": wanted}
        stops = request.get("stop_sequences")
        if stops:
            if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
                raise Refusal(400, '"stop_sequences" must be a list of strings.', param="stop_sequences")
            chat["stop"] = stops
        self.stop_sequences = stops or []
        for field in ("temperature", "top_p", "top_k"):
            if request.get(field) is not None:
                chat[field] = request[field]
        chat.update(_tools(request))
        self.streamed = request.get("stream") is True
        if self.streamed:
            chat["stream"] = True
            chat["stream_options"] = {"include_usage": True}
        self.chat = chat
        self.id = "msg_" + uuid.uuid4().hex[:24]

    def stop(self, finish: str | None, choice: dict) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence). Chat completions says "stop" for both the end of a
        turn and a stop sequence; vLLM names the sequence in `stop_reason`, llama.cpp does not."""
        matched = choice.get("stop_reason")
        if finish == "stop" and isinstance(matched, str) and matched in self.stop_sequences:
            return "stop_sequence", matched
        return STOP_REASONS.get(finish, "end_turn"), None

    def answer(self, completion: dict) -> dict:
        choice = completion["choices"][0]
        message = choice.get("message") or {}
        content = []
        if message.get("content"):
            content.append({"type": "text", "text": message["content"]})
        for call in message.get("tool_calls") or []:
            content.append(
                {
                    "type": "tool_use",
                    "id": call.get("id") or "toolu_" + uuid.uuid4().hex[:24],
                    "name": call["function"]["name"],
                    "input": _arguments(call["function"].get("arguments")),
                }
            )
        reason, sequence = self.stop(choice.get("finish_reason"), choice)
        usage = completion.get("usage") or {}
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": anthropic_usage(usage),
        }

    def stream(self) -> MessagesStream:
        return MessagesStream(self)

    def error(self, status: int, body: bytes) -> bytes:
        return error_body(status, engine_message(body))


def anthropic_usage(usage: dict) -> dict:
    """A chat completion's usage in Anthropic's shape, where input_tokens are the prompt's tokens not read
    from the cache and cache_read_input_tokens those that were (the engine's prompt cache: nothing is
    written to a cache on request, so cache_creation_input_tokens is 0)."""
    cached = cached_of(usage)
    return {
        "input_tokens": max(usage.get("prompt_tokens", 0) - cached, 0),
        "output_tokens": usage.get("completion_tokens", 0),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def _arguments(arguments) -> dict:
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments or "{}")
    except ValueError:
        return {"arguments": arguments}
    return parsed if isinstance(parsed, dict) else {"value": parsed}


class MessagesStream(ChatStream):
    """message_start, then each content block (start, deltas, stop), message_delta, message_stop."""

    def __init__(self, messages: Messages) -> None:
        super().__init__()
        self.messages = messages
        self.started = False
        self.block = -1  # the index of the open content block
        self.open_kind = None  # "text", or the tool call's index in the chat stream
        self.finish_reason = None
        self.last_choice: dict = {}
        self.usage: dict = {}

    def _start(self) -> bytes:
        self.started = True
        message = {
            "id": self.messages.id,
            "type": "message",
            "role": "assistant",
            "model": self.messages.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        return sse("message_start", {"type": "message_start", "message": message}) + sse("ping", {"type": "ping"})

    def _close(self) -> bytes:
        if self.open_kind is None:
            return b""
        self.open_kind = None
        return sse("content_block_stop", {"type": "content_block_stop", "index": self.block})

    def _open(self, kind, block: dict) -> bytes:
        out = self._close()
        self.block += 1
        self.open_kind = kind
        return out + sse(
            "content_block_start", {"type": "content_block_start", "index": self.block, "content_block": block}
        )

    def _delta(self, delta: dict) -> bytes:
        return sse("content_block_delta", {"type": "content_block_delta", "index": self.block, "delta": delta})

    def chunk(self, chunk: dict) -> bytes:
        out = b"" if self.started else self._start()
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            text = delta.get("content")
            if text:
                if self.open_kind != "text":
                    out += self._open("text", {"type": "text", "text": ""})
                # The event of every token, written without building a dict to encode.
                out += TEXT_DELTA % (self.block, json.dumps(text).encode())
            for call in delta.get("tool_calls") or []:
                index = call.get("index", 0)
                function = call.get("function") or {}
                if self.open_kind != ("tool", index):
                    block = {
                        "type": "tool_use",
                        "id": call.get("id") or "toolu_" + uuid.uuid4().hex[:24],
                        "name": function.get("name") or "",
                        "input": {},
                    }
                    out += self._open(("tool", index), block)
                if function.get("arguments"):
                    out += self._delta({"type": "input_json_delta", "partial_json": function["arguments"]})
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
                self.last_choice = choice
        return out

    def finish(self) -> bytes:
        out = b"" if self.started else self._start()
        out += self._close()
        reason, sequence = self.messages.stop(self.finish_reason, self.last_choice)
        usage = anthropic_usage(self.usage)
        out += sse(
            "message_delta",
            {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": usage},
        )
        return out + sse("message_stop", {"type": "message_stop"})

    def failed(self, chunk: dict) -> bytes:
        self.finished = True
        message = engine_message(json.dumps(chunk).encode())
        return sse("error", {"type": "error", "error": {"type": "api_error", "message": message}})
