"""Every error the gateway says, in the shape of the client's API: bodies, stream events, and a replica's errors read.

An OpenAI client shows an error's sentence only when it comes in OpenAI's shape, an
Anthropic client only in Anthropic's; a stream already begun can only end with an
error event of its own format. So each of those is written here, once per dialect
(endpoints.py names the dialects), and everything else calls these.
"""

from __future__ import annotations

import json

from .endpoints import ANTHROPIC, OPENAI, RESPONSES

# Anthropic's error type for each status the gateway or a replica answers.
ANTHROPIC_ERROR_TYPES = {
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


class Refusal(Exception):
    """A request the gateway answers itself, before or instead of a replica."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param
        self.headers = headers or []

    def body(self, dialect: str = OPENAI) -> bytes:
        return error_body(dialect, self.status, self.message, self.kind, self.code, self.param)


class ClientGone(Exception):
    """The client closed its connection; nothing more can be said to it."""


def _openai_error(message: str, kind: str, code: str | None, param: str | None = None) -> dict:
    return {"message": message, "type": kind, "param": param, "code": code}


def _anthropic_error(status: int, message: str) -> dict:
    kind = ANTHROPIC_ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_body(
    dialect: str,
    status: int,
    message: str,
    kind: str = "invalid_request_error",
    code: str | None = None,
    param: str | None = None,
) -> bytes:
    """An error answer's JSON body. Responses clients read OpenAI's shape."""
    if dialect == ANTHROPIC:
        return json.dumps(_anthropic_error(status, message)).encode()
    return json.dumps({"error": _openai_error(message, kind, code, param)}).encode()


def error_event(
    dialect: str,
    status: int,
    message: str,
    kind: str = "api_error",
    code: str | None = None,
    sequence_number: int = 0,
) -> bytes:
    """An error said inside an event stream, in the stream's format, ending it.

    `sequence_number` is the Responses stream's next number (its events are numbered).
    """
    if dialect == ANTHROPIC:
        return b"event: error\ndata: " + json.dumps(_anthropic_error(status, message)).encode() + b"\n\n"
    if dialect == RESPONSES:
        data = {"type": "error", "sequence_number": sequence_number, "code": code or kind, "message": message}
        return b"event: error\ndata: " + json.dumps({**data, "param": None}).encode() + b"\n\n"
    data = json.dumps({"error": _openai_error(message, kind, code)}).encode()
    return b"data: " + data + b"\n\ndata: [DONE]\n\n"


def error_of(body: bytes) -> tuple[str, str, str | None]:
    """(message, type, code) of an error body a replica (or the gateway) wrote, whatever its shape.

    OpenAI's and Anthropic's `error` object, an `error` string, FastAPI's `detail`, or
    else the body's own text.
    """
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        error = parsed.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"]), str(error.get("type") or "api_error"), error.get("code")
        if isinstance(error, str) and error:
            return error, "api_error", None
        if parsed.get("detail"):
            return str(parsed["detail"]), "api_error", None
    text = body.decode("utf-8", "replace").strip()[:2000]
    return text or "the replica refused the request", "api_error", None


def replica_error_body(dialect: str, status: int, body: bytes) -> bytes:
    """A replica's error answer (its status and body as it sent them) in the client's shape.

    One in OpenAI's shape already goes to an OpenAI-shaped client as it is.
    """
    if dialect != ANTHROPIC:
        try:
            parsed = json.loads(body)
            if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
                return body
        except ValueError:
            pass
    message, _, code = error_of(body)
    return error_body(dialect, status, message, "api_error" if status >= 500 else "invalid_request_error", code)
