"""What the gateway answers: one row per address, and every part of the gateway reads it.

An endpoint's facts were spread over nine places (the engine paths, the translations,
the kind each address is for, the metrics' labels, the stream formats, the patterns
for generated text, the 404's list) and had begun to disagree. They are here, once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# How an endpoint's errors, error events and streams are written.
OPENAI, ANTHROPIC, RESPONSES = "openai", "anthropic", "responses"


@dataclass(frozen=True)
class Endpoint:
    path: str  # the gateway's address
    engine_path: str  # where it goes on a replica, below the replica's /v1 base
    kind: str  # the kind of model that answers it: chat, embedding or rerank
    dialect: str  # OPENAI, or the API translated to chat completions (translation.py)
    metric: str  # its `kind` label on /metrics
    # A streamed chunk that carries generated text: a chat delta's "content" or a
    # completion's "text", not empty, as engines write JSON (no space or one after the
    # colon); what a stream cut short before its usage chunk is billed by (usage.py).
    # A literal start lets the regex engine skip ahead: about half a microsecond a chunk.
    generated: re.Pattern | None = None

    @property
    def translated(self) -> bool:
        return self.dialect != OPENAI


CHAT = "/v1/chat/completions"
MODELS = "/v1/models"

ENDPOINTS = {
    endpoint.path: endpoint
    for endpoint in (
        Endpoint(CHAT, "/chat/completions", "chat", OPENAI, "chat", re.compile(rb'"content": ?"[^"]')),
        Endpoint("/v1/completions", "/completions", "chat", OPENAI, "completion", re.compile(rb'"text": ?"[^"]')),
        Endpoint("/v1/embeddings", "/embeddings", "embedding", OPENAI, "embedding"),
        Endpoint("/v1/rerank", "/rerank", "rerank", OPENAI, "rerank"),
        # Translated: a chat completion from the gateway on, with the chat's engine path and kind.
        Endpoint("/v1/messages", "/chat/completions", "chat", ANTHROPIC, "messages"),
        Endpoint("/v1/responses", "/chat/completions", "chat", RESPONSES, "responses"),
    )
}


def dialect_of(path: str) -> str:
    """How an answer to `path` is written, for any path: an unknown one is answered in OpenAI's shape."""
    endpoint = ENDPOINTS.get(path)
    if endpoint is None and path.startswith("/v1/messages/"):
        return ANTHROPIC  # /v1/messages/count_tokens and the like: an Anthropic client, told in its shape
    return endpoint.dialect if endpoint else OPENAI


def listed() -> str:
    """The addresses, as the 404 for any other says them."""
    paths = [MODELS, *ENDPOINTS]
    return ", ".join(paths[:-1]) + " and " + paths[-1]


def answered_by(kind: str) -> str:
    """The addresses a kind of model answers, in OpenAI's API, as a refusal says them."""
    return " and ".join(e.path for e in ENDPOINTS.values() if e.kind == kind and not e.translated) or "nothing here"
