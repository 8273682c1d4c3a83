"""What a client sent: its body read within the limit, parsed, and checked against the model.

Each refusal is a Refusal with the sentence the client sees in OpenAI's error shape.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from . import routes
from .endpoints import ENDPOINTS, answered_by
from .errors import ClientGone, Refusal

# The longest a token of any model's vocabulary is, in characters: the bound a prompt's
# length is checked against. docs/gateway.md says where the figure comes from.
LONGEST_TOKEN_CHARS = 256
# The most answers one request may ask for (OpenAI's `n`): each is reserved against its key's windows.
MOST_CHOICES = 16


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


# The most JSON objects and arrays a body may hold, counted by their opening brackets (those in
# strings too, so a generous figure): a 32 MiB `[{},{},...]` is eleven million objects, a gigabyte
# of Python and seconds of a parser that holds the GIL (so no thread makes it cheap). A long
# conversation with tools is a few thousand. docs/gateway.md says more.
MOST_CONTAINERS = 100_000

# Keys of an engine's own (llama-server's) that reach around what the gateway bounds: the
# output limit (n_predict outranks max_tokens in llama-server), the prompt cache and its slots
# (an oracle of other keys' prompts), grammars compiled unchecked, the context shift, time
# limits, adapters, several completions at once. Refused unless LLMGW_GATEWAY_ENGINE_KEYS names
# them; OpenAI's own keys and samplers pass. docs/gateway.md says why each.
ENGINE_KEYS = {
    "n_predict": 'the output limit: send "max_tokens"',
    "id_slot": "a slot of the engine's prompt cache, shared by every key",
    "slot_id": "a slot of the engine's prompt cache, shared by every key",
    "cache_prompt": "the engine's prompt cache, shared by every key",
    "n_cache_reuse": "the engine's prompt cache, shared by every key",
    "grammar": 'a grammar the engine compiles unchecked: send "response_format"',
    "json_schema": 'a grammar the engine compiles unchecked: send "response_format"',
    "n_keep": "the engine's context shift",
    "n_discard": "the engine's context shift",
    "t_max_predict_ms": "the engine's time limits",
    "t_max_prompt_ms": "the engine's time limits",
    "n_cmpl": "several completions at once",
    "lora": "the engine's adapters",
}


def parse_request(body: bytes) -> dict:
    containers = body.count(b"{") + body.count(b"[")
    if containers > MOST_CONTAINERS:
        raise Refusal(
            413,
            f"The request body holds {containers} JSON objects and arrays (counted by their brackets), more than "
            f"the gateway reads in one request ({MOST_CONTAINERS}).",
        )
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


def check_engine_keys(request: dict, allowed: Iterable[str]) -> None:
    """Refuse an engine's own key that would reach around a bound (ENGINE_KEYS), unless the operator allows it."""
    for key in request.keys() & ENGINE_KEYS.keys():
        if key in allowed:
            continue
        raise Refusal(
            400,
            f'"{key}" is an engine\'s own key, which this gateway does not pass on: it reaches around '
            f"{ENGINE_KEYS[key]}.",
            param=key,
            code="engine_key_refused",
        )


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


def text_length(value) -> int:
    """The characters of every string in a request, keys aside: what an engine may be made to read.

    The template puts tools, response formats and grammars into the prompt as much as
    messages, so all of it counts. The walk is bounded by MOST_CONTAINERS.
    """
    length, pending = 0, [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            length += len(item)
        elif isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return length


def too_long(length: int, route: routes.Route, param: str, what: str = "The prompt") -> Refusal:
    most = route.context_length * LONGEST_TOKEN_CHARS
    return Refusal(
        400,
        f"{what} is {length} characters long; the context of {route.name} is {route.context_length} "
        f"tokens, which hold at most {most} characters (no token is longer than {LONGEST_TOKEN_CHARS}), "
        "so it cannot fit.",
        param=param,
        code="context_length_exceeded",
    )


def check_prompt_length(path: str, request: dict, route: routes.Route, body_bytes: int) -> None:
    """Refuse a prompt too long for the model's context by its length alone, before an engine reads it.

    An engine tokenizes a whole prompt before it can say that it does not fit, and a
    megabyte took llama.cpp over 30 s. No token is longer than LONGEST_TOKEN_CHARS
    characters, so a prompt longer than the context times that cannot fit. A body
    no longer than that bound cannot hold such a prompt (a character takes at least
    a byte of JSON), so ordinary requests are not counted at all. A chat's prompt is
    every string of the request (messages, tools, formats); an embedding's or a
    rerank's is each input, document and query on its own, as the engine reads them.
    """
    most = route.context_length * LONGEST_TOKEN_CHARS
    if body_bytes <= most or not most:  # a model without a context length is the engine's to judge
        return
    if route.kind == "chat":
        length = text_length({k: v for k, v in request.items() if k != "model"})
        if length > most:
            raise too_long(length, route, "messages" if path == "/v1/chat/completions" else "prompt")
        return
    for field in ("input", "query", "documents"):
        value = request.get(field)
        for item in value if isinstance(value, list) else [value]:
            length = text_length(item)
            if length > most:
                raise too_long(length, route, field, f"An item of {field!r}")


def check_limits(path: str, request: dict, route: routes.Route, body_bytes: int) -> int:
    """Refuse what the model cannot do, before a replica spends time on it; the answer's most tokens.

    A chat request without max_tokens is given the model's output limit (sent to the
    engine, so no answer runs past it): what it may cost is known before it goes, and
    reserved against its key's token windows (limits.py). A model without an output
    limit is bounded by its context. A prompt that may fit by its length but not in
    tokens is refused by the engine itself, the one that knows its tokenizer; its 400
    is passed on as it is.
    """
    check_prompt_length(path, request, route, body_bytes)
    if route.kind != "chat":
        return 0
    field = "max_completion_tokens" if request.get("max_completion_tokens") is not None else "max_tokens"
    wanted = request.get(field)
    if wanted is None:
        if route.max_output:
            request["max_tokens"] = route.max_output
        wanted = route.max_output or route.context_length
    elif isinstance(wanted, bool) or not isinstance(wanted, int) or wanted < 1:
        raise Refusal(400, f'"{field}" must be a whole number of at least 1.', param=field)
    elif route.max_output and wanted > route.max_output:
        raise Refusal(
            400,
            f"{field} is {wanted}, above the output limit of {route.name}, which is {route.max_output} tokens.",
            param=field,
            code="max_tokens_too_large",
        )
    elif wanted >= route.context_length:
        raise Refusal(
            400,
            f"{field} is {wanted}, which leaves no room for the prompt in the context length of "
            f"{route.name}, which is {route.context_length} tokens.",
            param=field,
            code="context_length_exceeded",
        )
    # Several answers (OpenAI's n) may each be as long; what is not a count is the engine's to refuse.
    choices = request.get("n")
    if isinstance(choices, bool) or not isinstance(choices, int) or choices < 1:
        return wanted
    if choices > MOST_CHOICES:
        raise Refusal(400, f'"n" is {choices}; this gateway gives at most {MOST_CHOICES} answers a request.', param="n")
    return wanted * choices
