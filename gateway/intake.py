"""What a client sent: its body read within the limit, parsed, and checked against the model.

Each refusal is a Refusal with the sentence the client sees in OpenAI's error shape.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

from . import routes
from .anthropic_messages import Messages
from .endpoints import ANTHROPIC, CHAT, ENDPOINTS, RESPONSES, Endpoint, answered_by
from .errors import ClientGone, Refusal
from .openai_responses import Responses
from .translation import Translation

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

# What each address passes on: the keys of its API's request, as the official clients' create()
# takes them (openai 3.x, anthropic 2.x; tests/test_gateway_engine_keys.py holds the lists to
# the clients'), and a few samplers both engines read under one name. Any other key is refused
# unless LLMGW_GATEWAY_ENGINE_KEYS names it: an engine's own keys reach around what the gateway
# bounds (n_predict outranks max_tokens in llama-server; id_slot and cache_prompt make the
# prompt cache an oracle of other keys' prompts; grammars are compiled unchecked; an
# embedding's "content" or a rerank's "texts" is a prompt the length guard does not read), and
# the engines add new ones with every release. docs/gateway.md has the table.
SAMPLERS = frozenset("seed top_k min_p typical_p repeat_penalty repetition_penalty ignore_eos".split())
CHAT_KEYS = frozenset(
    """model messages stream stream_options max_tokens max_completion_tokens n stop temperature top_p
    frequency_penalty presence_penalty logit_bias logprobs top_logprobs seed response_format tools tool_choice
    parallel_tool_calls functions function_call reasoning_effort verbosity user metadata store service_tier
    modalities audio prediction web_search_options prompt_cache_key prompt_cache_options prompt_cache_retention
    safety_identifier moderation""".split()
)
COMPLETION_KEYS = frozenset(
    # Not best_of: that many answers are made for each one returned, past what "n" reserves.
    """model prompt suffix echo stream stream_options max_tokens n stop temperature top_p frequency_penalty
    presence_penalty logit_bias logprobs seed user""".split()
)
# Translated (translation.py): what the translation reads, or leaves aside as meaningless here.
MESSAGES_KEYS = frozenset(
    """model messages system max_tokens stop_sequences stream temperature top_p top_k tools tool_choice
    metadata thinking service_tier cache_control container diagnostics inference_geo output_config speed
    user_profile_id workspace_id""".split()
)
RESPONSES_KEYS = frozenset(
    """model input instructions max_output_tokens stream stream_options temperature top_p top_logprobs tools
    tool_choice parallel_tool_calls max_tool_calls text reasoning metadata store include truncation
    previous_response_id background background_options conversation prompt prompt_cache_key
    prompt_cache_options prompt_cache_retention safety_identifier service_tier user context_management
    moderation image access_programs""".split()
)
PASSED = {
    "/v1/chat/completions": CHAT_KEYS | SAMPLERS,
    "/v1/completions": COMPLETION_KEYS | SAMPLERS,
    "/v1/embeddings": frozenset("model input dimensions encoding_format user".split()),
    # The rerank of llama-server, vLLM, Jina and Cohere: not TEI's "texts", which the length guard does not read.
    "/v1/rerank": frozenset("model query documents top_n return_documents".split()),
    # The samplers go to the engine as they are, past the translation.
    "/v1/messages": MESSAGES_KEYS | SAMPLERS,
    "/v1/responses": RESPONSES_KEYS | SAMPLERS,
}
# Why some keys are refused, for the sentence a client gets; every other key is simply not on its address's list.
REFUSED_BECAUSE = {
    "n_predict": 'it reaches around the output limit: send "max_tokens"',
    "id_slot": "it names a slot of the engine's prompt cache, which every key shares",
    "slot_id": "it names a slot of the engine's prompt cache, which every key shares",
    "cache_prompt": "it steers the engine's prompt cache, which every key shares",
    "n_cache_reuse": "it steers the engine's prompt cache, which every key shares",
    "grammar": 'it is a grammar the engine compiles unchecked: send "response_format"',
    "json_schema": 'it is a grammar the engine compiles unchecked: send "response_format"',
    "n_keep": "it steers the engine's context shift",
    "n_discard": "it steers the engine's context shift",
    "n_cmpl": 'it asks for several answers past "n"',
    "best_of": 'it makes several answers for each one returned, past what "n" reserves',
    "lora": "it picks the engine's adapters",
    "content": 'it is an input the length guard does not read: send "input"',
    "texts": 'it is an input the length guard does not read: send "documents"',
}
# OpenAI's own bounds on the alternatives an answer lists per token: each is a row of the
# vocabulary the engine sorts and the gateway relays, so a larger count multiplies both.
MOST_LOGPROBS = {"top_logprobs": 20}
MOST_COMPLETION_LOGPROBS = 5


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


def check_keys(path: str, request: dict, allowed: Iterable[str]) -> dict:
    """Refuse a key `path` does not pass on (PASSED) unless the operator allows it; those the operator allows.

    What is returned is what a translated request carries to the engine as it is, past its
    translation: the operator's keys and the samplers, which no translation reads.
    """
    passed = PASSED.get(path, frozenset())
    allowed = frozenset(allowed)
    for key in request:
        if key in passed or key in allowed:
            continue
        why = f" ({REFUSED_BECAUSE[key]})" if key in REFUSED_BECAUSE else ""
        raise Refusal(
            400,
            f'"{key}" is not passed to the engine{why}; the operator can allow it with LLMGW_GATEWAY_ENGINE_KEYS.',
            param=key,
            code="engine_key_refused",
        )
    check_logprobs(path, request)
    return {key: request[key] for key in request.keys() & (allowed | SAMPLERS)}


def check_logprobs(path: str, request: dict) -> None:
    most = dict(MOST_LOGPROBS)
    if path == "/v1/completions":  # a count there; chat's "logprobs" is true or false
        most["logprobs"] = MOST_COMPLETION_LOGPROBS
    for key, bound in most.items():
        value = request.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and not 0 <= value <= bound:
            raise Refusal(400, f'"{key}" is {value}; it must be from 0 to {bound}.', param=key)


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
    reserved against its key's token windows (gateway/limits/). A model without an output
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


# Other clients' APIs, translated to chat completions for the engines (translation.py), by dialect.
TRANSLATIONS = {ANTHROPIC: Messages, RESPONSES: Responses}


@dataclass
class Taken:
    """A request's body as the gateway took it in: what take() makes of it."""

    endpoint: Endpoint
    request: dict  # as a chat (or completion, embedding, rerank) request
    translation: Translation | None
    route: routes.Route
    output: int  # the most tokens its answer may have (check_limits), 0 for other kinds
    body: bytes  # what the engine is sent
    client_wants_usage: bool


def take(table: routes.Table, path: str, key: routes.Key, body: bytes, engine_keys: Iterable[str]) -> Taken:
    """A body read: parsed, translated, checked against its model in `table`, and encoded again for the engine.

    `engine_keys`: the body keys passed on besides an address's own (LLMGW_GATEWAY_ENGINE_KEYS). Runs in a
    thread for a large body: it touches nothing of the event loop's but the table it reads.
    """
    endpoint = ENDPOINTS[path]
    request = parse_request(body)
    carried = check_keys(path, request, engine_keys)
    translation = None
    if endpoint.translated:
        translation = TRANSLATIONS[endpoint.dialect](request)
        request = translation.chat
        for name, value in carried.items():
            request.setdefault(name, value)
    name = request["model"]
    route = table.routes.get(name)
    if route is None:
        raise Refusal(
            404,
            f"There is no model named {name!r} here; GET /v1/models lists the models and their aliases.",
            code="model_not_found",
            param="model",
        )
    if not key.may_use(route.name):
        raise Refusal(
            403,
            f"This API key may not use the model {route.name}.",
            kind="permission_error",
            code="model_not_allowed",
        )
    # A translated request is a chat completion from here on, and is checked as one.
    checked_as = path if translation is None else CHAT
    check_kind(checked_as, route)
    sent_max = request.get("max_tokens")
    output = check_limits(checked_as, request, route, len(body))
    changed = translation is not None or request.get("max_tokens") != sent_max
    if name != route.name:
        # Engines know a model by its catalog name (vLLM refuses any other), not by its aliases.
        request["model"], changed = route.name, True
    client_wants_usage = True
    if request.get("stream") is True and route.kind == "chat":
        options = request.get("stream_options")
        client_wants_usage = isinstance(options, dict) and options.get("include_usage") is True
        if not client_wants_usage:
            request["stream_options"], changed = dict(options or {}, include_usage=True), True
    if changed:
        body = json.dumps(request).encode()
    return Taken(endpoint, request, translation, route, output, body, client_wants_usage)
