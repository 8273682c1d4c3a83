"""OpenAI's Responses API at `/v1/responses`, the stateless part, translated to and from chat completions.

What new OpenAI SDK code and agent frameworks call first: `input` as a string or
items (messages, function calls and their outputs), `instructions`,
`max_output_tokens`, function tools. Stored responses are not kept, so a request
that names a previous response is refused with a sentence saying so.
"""

from __future__ import annotations

import json
import time
import uuid

from .endpoints import RESPONSES
from .errors import Refusal, error_event
from .events import sse
from .translation import ChatStream, Translation, text_of
from .usage import cached_shown

TEXT_DELTA = (
    b'event: response.output_text.delta\ndata: {"type": "response.output_text.delta", "sequence_number": %d, '
    b'"item_id": "%s", "output_index": %d, "content_index": 0, "delta": %s, "logprobs": []}\n\n'
)
# Fields the answer repeats from the request, as OpenAI's does.
ECHOED = ("instructions", "max_output_tokens", "temperature", "top_p", "tool_choice", "parallel_tool_calls")


def _input(request: dict) -> list[dict]:
    chat = []
    if request.get("instructions"):
        chat.append({"role": "system", "content": text_of(request["instructions"], '"instructions"')})
    given = request.get("input")
    if isinstance(given, str):
        chat.append({"role": "user", "content": given})
        return chat
    if not isinstance(given, list) or not given:
        raise Refusal(400, '"input" must be a string or a list of items.', param="input")
    for n, item in enumerate(given):
        where = f"input[{n}]"
        if not isinstance(item, dict):
            raise Refusal(400, f"{where} must be an object.", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise Refusal(400, f"{where} has role {role!r}; it must be user, assistant, system or developer.")
            chat.append(
                {"role": "system" if role == "developer" else role, "content": text_of(item.get("content"), where)}
            )
        elif kind == "function_call":
            call = {
                "id": str(item.get("call_id", "")),
                "type": "function",
                "function": {"name": str(item.get("name", "")), "arguments": str(item.get("arguments", "{}"))},
            }
            last = chat[-1] if chat else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)  # calls made together go in one assistant message
            else:
                chat.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            chat.append(
                {
                    "role": "tool",
                    "tool_call_id": str(item.get("call_id", "")),
                    "content": output if isinstance(output, str) else text_of(output, f"{where}.output"),
                }
            )
        elif kind == "reasoning":
            continue
        else:
            raise Refusal(400, f"{where} is an item of type {kind!r}, which this gateway does not take.", param="input")
    return chat


def _tools(request: dict) -> dict:
    out = {}
    tools = request.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise Refusal(400, '"tools" must be a list.', param="tools")
        out["tools"] = []
        for tool in tools:
            if not isinstance(tool, dict) or tool.get("type") != "function" or not tool.get("name"):
                kind = tool.get("type") if isinstance(tool, dict) else None
                raise Refusal(
                    400, f"Only function tools with a name are served here, not {kind!r} tools.", param="tools"
                )
            function = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object"}}
            if tool.get("description"):
                function["description"] = tool["description"]
            out["tools"].append({"type": "function", "function": function})
    choice = request.get("tool_choice")
    if isinstance(choice, str):
        out["tool_choice"] = choice
    elif isinstance(choice, dict):
        if choice.get("type") != "function" or not choice.get("name"):
            raise Refusal(
                400, '"tool_choice" must be auto, none, required, or a function by name.', param="tool_choice"
            )
        out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    if isinstance(request.get("parallel_tool_calls"), bool):
        out["parallel_tool_calls"] = request["parallel_tool_calls"]
    return out


def _format(request: dict) -> dict:
    """`text.format` (structured output) as chat's `response_format`."""
    text = request.get("text")
    form = text.get("format") if isinstance(text, dict) else None
    if not isinstance(form, dict) or form.get("type") in (None, "text"):
        return {}
    if form["type"] == "json_object":
        return {"response_format": {"type": "json_object"}}
    if form["type"] == "json_schema":
        schema = {"name": form.get("name") or "answer", "schema": form.get("schema") or {}}
        if form.get("strict") is not None:
            schema["strict"] = form["strict"]
        return {"response_format": {"type": "json_schema", "json_schema": schema}}
    raise Refusal(400, f'"text.format" of type {form["type"]!r} is not one of text, json_object, json_schema.')


class Responses(Translation):
    dialect = RESPONSES

    def __init__(self, request: dict) -> None:
        if request.get("previous_response_id"):
            raise Refusal(
                400,
                "previous_response_id is not served: this gateway keeps no responses. Send the whole "
                "conversation in input, as items, instead.",
                param="previous_response_id",
                code="stored_responses_unsupported",
            )
        self.model = request["model"]
        chat = {"model": self.model, "messages": _input(request)}
        wanted = request.get("max_output_tokens")
        if wanted is not None:
            chat["max_tokens"] = wanted
        for field in ("temperature", "top_p"):
            if request.get(field) is not None:
                chat[field] = request[field]
        chat.update(_tools(request))
        chat.update(_format(request))
        self.streamed = request.get("stream") is True
        if self.streamed:
            chat["stream"] = True
            chat["stream_options"] = {"include_usage": True}
        self.chat = chat
        self.echo = {field: request.get(field) for field in ECHOED}
        self.echo["tools"] = request.get("tools") or []
        self.echo["metadata"] = request.get("metadata") or {}
        self.echo["text"] = (
            request.get("text") if isinstance(request.get("text"), dict) else {"format": {"type": "text"}}
        )
        self.id = "resp_" + uuid.uuid4().hex
        self.created = int(time.time())

    def response(self, status: str, output: list, usage: dict | None, finish: str | None = None) -> dict:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": output,
            "usage": usage,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            "truncation": "disabled",
            "store": False,
            "previous_response_id": None,
            **self.echo,
            "tool_choice": self.echo["tool_choice"] or "auto",
            "parallel_tool_calls": self.echo["parallel_tool_calls"] is not False,
        }

    def answer(self, completion: dict) -> dict:
        choice = completion["choices"][0]
        message = choice.get("message") or {}
        output = []
        if message.get("content"):
            output.append(message_item("msg_" + uuid.uuid4().hex, message["content"], "completed"))
        for call in message.get("tool_calls") or []:
            function = call["function"]
            output.append(call_item(call.get("id"), function["name"], function.get("arguments") or "", "completed"))
        finish = choice.get("finish_reason")
        status = "incomplete" if finish == "length" else "completed"
        return self.response(status, output, responses_usage(completion.get("usage")), finish)

    def stream(self) -> ResponsesStream:
        return ResponsesStream(self)


def responses_usage(usage: dict | None) -> dict:
    """The engine's usage (a chat completion's) as the Responses API's `usage`: the one place it is mapped."""
    usage = usage or {}
    prompt, completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached_shown(usage)},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.get("total_tokens", prompt + completion),
    }


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [text_part(text)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def call_item(call_id: str | None, name: str, arguments: str, status: str) -> dict:
    call_id = call_id or "call_" + uuid.uuid4().hex[:24]
    return {
        "type": "function_call",
        "id": "fc_" + uuid.uuid4().hex,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


class ResponsesStream(ChatStream):
    """response.created and .in_progress; each output item added, its deltas, done; response.completed."""

    dialect = RESPONSES

    def __init__(self, responses: Responses) -> None:
        super().__init__()
        self.responses = responses
        self.sequence = 0
        self.output: list[dict] = []  # the items so far; the last is the open one while a block is open

    def _event(self, kind: str, **fields) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return sse(kind, data)

    def opening(self) -> bytes:
        response = self.responses.response("in_progress", [], None)
        return self._event("response.created", response=response) + self._event(
            "response.in_progress", response=response
        )

    def _added(self, item: dict) -> bytes:
        self.output.append(item)
        index = len(self.output) - 1
        added = dict(item, status="in_progress", content=[]) if item["type"] == "message" else dict(item)
        return self._event("response.output_item.added", output_index=index, item=added)

    def text_opened(self) -> bytes:
        item = message_item("msg_" + uuid.uuid4().hex, "", "in_progress")
        out = self._added(item)
        return out + self._event(
            "response.content_part.added",
            item_id=item["id"],
            output_index=len(self.output) - 1,
            content_index=0,
            part=text_part(""),
        )

    def text(self, text: str) -> bytes:
        item = self.output[-1]
        item["content"][0]["text"] += text
        # The event of every token, written without building a dict to encode.
        out = TEXT_DELTA % (self.sequence, item["id"].encode(), len(self.output) - 1, json.dumps(text).encode())
        self.sequence += 1
        return out

    def tool_opened(self, call_id: str | None, name: str) -> bytes:
        return self._added(call_item(call_id, name, "", "in_progress"))

    def tool_arguments(self, piece: str) -> bytes:
        item = self.output[-1]
        item["arguments"] += piece
        return self._event(
            "response.function_call_arguments.delta",
            item_id=item["id"],
            output_index=len(self.output) - 1,
            delta=piece,
        )

    def closed(self) -> bytes:
        item = self.output[-1]
        index = len(self.output) - 1
        item["status"] = "completed"
        if item["type"] == "message":
            part = item["content"][0]
            out = self._event(
                "response.output_text.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                text=part["text"],
                logprobs=[],
            )
            out += self._event(
                "response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part
            )
        else:
            out = self._event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                name=item["name"],
                arguments=item["arguments"],
            )
        return out + self._event("response.output_item.done", output_index=index, item=item)

    def ending(self) -> bytes:
        incomplete = self.finish_reason == "length"
        response = self.responses.response(
            "incomplete" if incomplete else "completed", self.output, responses_usage(self.usage), self.finish_reason
        )
        return self._event("response.incomplete" if incomplete else "response.completed", response=response)

    def error(self, message: str, code: str) -> bytes:
        out = error_event(RESPONSES, 500, message, "api_error", code, sequence_number=self.sequence)
        self.sequence += 1
        return out
