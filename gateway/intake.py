"""What a client sent: its body read within the limit, parsed, and checked against the model.

Each refusal is a Refusal with the sentence the client sees in OpenAI's error shape.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from . import routes
from .endpoints import ENDPOINTS, answered_by
from .errors import ClientGone, Refusal

# The longest a token of any model's vocabulary is, in characters: the bound a prompt's
# length is checked against. docs/gateway.md says where the figure comes from.
LONGEST_TOKEN_CHARS = 256


def sentence_of(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.rstrip(".")


async def read_body(receive, limit: int) -> bytes:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise Refusal(413, f"The request body is larger than the gateway's limit of {limit} bytes.")
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


def parse_request(body: bytes) -> dict:
    try:
        request = json.loads(body)
    except ValueError as error:
        raise Refusal(400, f"The request body is not valid JSON: {sentence_of(error)}.") from None
    except RecursionError:
        raise Refusal(400, "The request body is JSON nested too deeply to read.") from None
    if not isinstance(request, dict):
        raise Refusal(400, "The request body must be a JSON object.")
    model = request.get("model")
    if not isinstance(model, str) or not model:
        raise Refusal(400, 'Say which model to use: the request has no "model".', param="model")
    if "stream" in request and not isinstance(request["stream"], bool):
        raise Refusal(400, '"stream" must be true or false.', param="stream")
    options = request.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise Refusal(400, '"stream_options" must be an object, like {"include_usage": true}.', param="stream_options")
    return request


def check_kind(path: str, route: routes.Route) -> None:
    """Refuse an address the model's kind does not answer: its engine was not started for it."""
    endpoint = ENDPOINTS.get(path)
    if endpoint is None or endpoint.kind == route.kind:
        return
    wanted = endpoint.kind
    raise Refusal(
        400,
        f"{route.name} is a {route.kind} model: it answers {answered_by(route.kind)}, "
        f"not {path}, which is for {wanted} models.",
        param="model",
        code="wrong_model_kind",
    )


def prompt_texts(path: str, request: dict) -> Iterator[str]:
    """The text a request asks the model to read: chat messages' contents, a completion's prompt.

    Whatever is not text in the expected shape is skipped; the engine refuses it with its own sentence.
    """
    if path == "/v1/chat/completions":
        messages = request.get("messages")
        for message in messages if isinstance(messages, list) else ():
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            if isinstance(content, str):
                yield content
            elif isinstance(content, list):
                for part in content:
                    if isinstance(part, dict) and isinstance(part.get("text"), str):
                        yield part["text"]
            calls = message.get("tool_calls")
            for call in calls if isinstance(calls, list) else ():
                function = call.get("function") if isinstance(call, dict) else None
                if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                    yield function["arguments"]
    elif path == "/v1/completions":
        prompt = request.get("prompt")
        if isinstance(prompt, str):
            yield prompt
        elif isinstance(prompt, list):
            yield from (item for item in prompt if isinstance(item, str))


def check_prompt_length(path: str, request: dict, route: routes.Route, body_bytes: int) -> None:
    """Refuse a prompt too long for the model's context by its length alone, before an engine reads it.

    An engine tokenizes a whole prompt before it can say that it does not fit, and a
    megabyte took llama.cpp over 30 s. No token is longer than LONGEST_TOKEN_CHARS
    characters, so a prompt longer than the context times that cannot fit. A body
    no longer than that bound cannot hold such a prompt (a character takes at least
    a byte of JSON), so ordinary requests are not counted at all.
    """
    most = route.context_length * LONGEST_TOKEN_CHARS
    if body_bytes <= most or not most:  # a model without a context length is the engine's to judge
        return
    length = sum(len(text) for text in prompt_texts(path, request))
    if length > most:
        raise Refusal(
            400,
            f"The prompt is {length} characters long; the context of {route.name} is {route.context_length} "
            f"tokens, which hold at most {most} characters (no token is longer than {LONGEST_TOKEN_CHARS}), "
            "so it cannot fit.",
            param="messages" if path == "/v1/chat/completions" else "prompt",
            code="context_length_exceeded",
        )


def check_limits(path: str, request: dict, route: routes.Route, body_bytes: int) -> None:
    """Refuse what the model cannot do, before a replica spends time on it.

    A prompt that may fit by its length but not in tokens is refused by the engine
    itself, the one that knows its tokenizer; its 400 is passed on as it is.
    """
    if route.kind != "chat":
        return
    check_prompt_length(path, request, route, body_bytes)
    field = "max_completion_tokens" if request.get("max_completion_tokens") is not None else "max_tokens"
    wanted = request.get(field)
    if wanted is None:
        return
    if isinstance(wanted, bool) or not isinstance(wanted, int) or wanted < 1:
        raise Refusal(400, f'"{field}" must be a whole number of at least 1.', param=field)
    if route.max_output and wanted > route.max_output:
        raise Refusal(
            400,
            f"{field} is {wanted}, above the output limit of {route.name}, which is {route.max_output} tokens.",
            param=field,
            code="max_tokens_too_large",
        )
    if wanted >= route.context_length:
        raise Refusal(
            400,
            f"{field} is {wanted}, which leaves no room for the prompt in the context length of "
            f"{route.name}, which is {route.context_length} tokens.",
            param=field,
            code="context_length_exceeded",
        )
