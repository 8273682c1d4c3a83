"""Anthropic's Messages API at `/v1/messages`, translated to and from chat completions.

What Claude-style clients and coding tools send: a system prompt, messages of
content blocks (text, tool_use, tool_result), `max_tokens` (required),
stop sequences, tools. Answers, errors and streamed events are in Anthropic's
shape, so the `anthropic` client reads them as it reads Anthropic's own.
"""

from __future__ import annotations

import json
import uuid

from .endpoints import ANTHROPIC
from .errors import Refusal
from .events import sse
from .translation import ChatStream, Translation, text_of
from .usage import cached_shown

TEXT_DELTA = (
    b'event: content_block_delta\ndata: {"type": "content_block_delta", "index": %d, '
    b'"delta": {"type": "text_delta", "text": %s}}\n\n'
)
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "function_call": "tool_use"}


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
    dialect = ANTHROPIC

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
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": anthropic_usage(completion.get("usage")),
        }

    def stream(self) -> MessagesStream:
        return MessagesStream(self)


def anthropic_usage(usage: dict | None) -> dict:
    """The engine's usage (a chat completion's) in Anthropic's shape, the one place it is mapped: input_tokens
    are the prompt's tokens not read from the cache and cache_read_input_tokens those that were (the engine's
    prompt cache: nothing is written to a cache on request, so cache_creation_input_tokens is 0)."""
    usage = usage or {}
    cached = cached_shown(usage)
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

    dialect = ANTHROPIC

    def __init__(self, messages: Messages) -> None:
        super().__init__()
        self.messages = messages
        self.block = -1  # the index of the open content block

    def opening(self) -> bytes:
        message = {
            "id": self.messages.id,
            "type": "message",
            "role": "assistant",
            "model": self.messages.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": anthropic_usage(None),
        }
        return sse("message_start", {"type": "message_start", "message": message}) + sse("ping", {"type": "ping"})

    def _block(self, block: dict) -> bytes:
        self.block += 1
        return sse("content_block_start", {"type": "content_block_start", "index": self.block, "content_block": block})

    def text_opened(self) -> bytes:
        return self._block({"type": "text", "text": ""})

    def text(self, text: str) -> bytes:
        # The event of every token, written without building a dict to encode.
        return TEXT_DELTA % (self.block, json.dumps(text).encode())

    def tool_opened(self, call_id: str | None, name: str) -> bytes:
        return self._block(
            {"type": "tool_use", "id": call_id or "toolu_" + uuid.uuid4().hex[:24], "name": name, "input": {}}
        )

    def tool_arguments(self, piece: str) -> bytes:
        delta = {"type": "input_json_delta", "partial_json": piece}
        return sse("content_block_delta", {"type": "content_block_delta", "index": self.block, "delta": delta})

    def closed(self) -> bytes:
        return sse("content_block_stop", {"type": "content_block_stop", "index": self.block})

    def ending(self) -> bytes:
        reason, sequence = self.messages.stop(self.finish_reason, self.last_choice)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        usage = anthropic_usage(self.usage)
        return sse("message_delta", {"type": "message_delta", "delta": delta, "usage": usage}) + sse(
            "message_stop", {"type": "message_stop"}
        )
