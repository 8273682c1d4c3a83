"""Errors in OpenAI's JSON shape, so every OpenAI client shows the sentence rather than a parse error."""

from __future__ import annotations

import json


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

    def body(self) -> bytes:
        error = {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}
        return json.dumps({"error": error}).encode()


class ClientGone(Exception):
    """The client closed its connection; nothing more can be said to it."""
