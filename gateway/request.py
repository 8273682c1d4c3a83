"""One client's request on its way through the gateway, and the one watcher of its client's connection."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .endpoints import Endpoint
    from .hold import HeldStream
    from .routes import Key, Route
    from .translation import Translation


class HangUp:
    """Watches a client's connection for its hang-up, from when its body is read until it is answered.

    One per request, the only reader of `receive` after the body: holding waits on
    `gone` beside its replica (gateway/hold.py); a relay `guard`s the task passing the
    answer on, which is cancelled if the client leaves before the answer is all sent,
    and that closes the replica's connection, which is what makes the engine stop.
    """

    def __init__(self, receive) -> None:
        loop = asyncio.get_running_loop()
        self.gone = loop.create_future()
        self._guarded: asyncio.Task | None = None
        self._cancelled = False
        self._watcher = loop.create_task(self._watch(receive))

    async def _watch(self, receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                # uvicorn says this also once the answer is complete; then nothing is guarded.
                self.gone.set_result(None)
                if self._guarded is not None:
                    self._cancelled = True
                    self._guarded.cancel()
                return

    def guard(self) -> None:
        """From now on the client's leaving cancels the current task."""
        self._guarded = asyncio.current_task()
        if self.gone.done():  # gone already, between two replicas' tries
            self._cancelled = True
            self._guarded.cancel()

    def unguard(self) -> None:
        """The answer is all but sent (or over): a hang-up now cancels nothing."""
        self._guarded = None

    def client_left(self) -> bool:
        """In `except CancelledError`: whether the client's leaving caused it (then the task is uncancelled)."""
        if not self._cancelled:
            return False
        self._cancelled = False
        asyncio.current_task().uncancel()
        return True

    def close(self) -> None:
        self._guarded = None
        self._watcher.cancel()


@dataclass
class Request:
    """What the gateway knows of a request once it is routed: the arguments of answer(), forward() and the relays."""

    scope: dict
    send: object  # the ASGI send, or the HeldStream in front of it for a streamed request
    hang_up: HangUp
    held: HeldStream | None  # a streamed request's send while and after it waits for a replica
    key: Key
    route: Route  # read again from the table while the request waits for a replica
    endpoint: Endpoint
    payload: dict  # the request as a chat (or completion, embedding, rerank) request: what usage counts
    body: bytes  # what is sent to the replica: the payload, encoded again when the gateway changed it
    translation: Translation | None  # for a request in Anthropic's or the Responses API
    client_wants_usage: bool  # a stream's usage-only chunk is passed on only when the client asked for it
    started: float  # perf_counter() when the request came
    # Counts an answer's tokens and cost against its key's limits and its team's budgets (Limiter.settled), for
    # a request that has any: awaited before its client has the last of the answer.
    settle: Callable[[int, int], Awaitable[None]] | None = None

    @property
    def dialect(self) -> str:
        return self.endpoint.dialect
