"""The limiter's one connection to Redis: commands gathered and written once a turn of the event loop, replies read
by hiredis, and a watchdog that cuts a connection Redis stopped answering on.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import ssl
from collections.abc import Callable

import hiredis

log = logging.getLogger("llmgw.gateway")

# How long Redis may stay silent before the requests waiting on it go on unchecked (at most twice this).
TIMEOUT_S = 2.0


def ssl_context(address: dict) -> ssl.SSLContext | None:
    """rediss://'s TLS as redis-py reads its query: ssl_cert_reqs (none|optional|required) and ssl_ca_certs."""
    if "ssl_cert_reqs" not in address and "ssl_ca_certs" not in address:
        cls = address.get("connection_class")
        if cls is None or "SSL" not in cls.__name__:
            return None
    context = ssl.create_default_context(cafile=address.get("ssl_ca_certs"))
    reqs = address.get("ssl_cert_reqs", "required")
    if reqs in ("none", ssl.CERT_NONE):
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    elif reqs in ("optional", ssl.CERT_OPTIONAL):
        context.check_hostname = False
        context.verify_mode = ssl.CERT_OPTIONAL
    return context


class RedisError(Exception):
    """Redis could not be asked, or answered with an error."""


class Pipe(asyncio.Protocol):
    """One connection to Redis, shared by every request of the process.

    What a limited request paid here was mostly system calls: a write for its admission,
    a write for its settling, a read for each reply. So commands are not written when
    made but gathered, and written together once a turn of the event loop (`flush`);
    Redis answers them in one go, and hiredis (the C parser redis-py uses) reads the
    replies, which come back in the order the commands were sent: each one's callback
    waits in a queue. A reply overdue by TIMEOUT_S cuts the connection, and every
    command waiting on it fails, so no request waits on a Redis that went silent.
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.reader = hiredis.Reader(replyError=RedisError)
        self.waiting: collections.deque[Callable[[object], None]] = collections.deque()
        self.outgoing: list[bytes] = []
        self._loop = asyncio.get_running_loop()
        self._flush_soon = False
        self._replies = 0  # replies read so far, for the watchdog
        self._watchdog: asyncio.TimerHandle | None = None
        self._idle: asyncio.Future | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.transport = None
        self.outgoing.clear()
        failure = RedisError(f"the connection to Redis closed: {exc or 'by Redis'}")
        while self.waiting:
            self.waiting.popleft()(failure)
        self._went_idle()

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        while self.waiting:
            reply = self.reader.gets()
            if reply is False:
                break
            self._replies += 1
            self.waiting.popleft()(reply)
        if not self.waiting:
            self._went_idle()

    def send(self, command: bytes, then: Callable[[object], None]) -> None:
        """Write `command` (packed) with the next flush; `then` gets its reply, or a RedisError."""
        if self.transport is None:
            then(RedisError("the connection to Redis closed"))
            return
        self.outgoing.append(command)
        self.waiting.append(then)
        if not self._flush_soon:
            self._flush_soon = True
            self._loop.call_soon(self.flush)
        if self._watchdog is None:
            self._watchdog = self._loop.call_later(TIMEOUT_S, self._check, self._replies)

    def ask(self, *parts) -> asyncio.Future:
        """`send`, for a caller that awaits the reply."""
        future = self._loop.create_future()
        self.send(hiredis.pack_command(parts), lambda reply: resolve(future, reply))
        return future

    def flush(self) -> None:
        self._flush_soon = False
        if self.outgoing and self.transport is not None:
            self.transport.write(b"".join(self.outgoing))
            self.outgoing.clear()

    def _check(self, replies_then: int) -> None:
        self._watchdog = None
        if not self.waiting:
            return
        if self._replies == replies_then and self.transport is not None:
            log.warning("Redis did not answer within %g s: the connection is closed and opened again", TIMEOUT_S)
            self.transport.abort()  # connection_lost fails everything waiting
            return
        self._watchdog = self._loop.call_later(TIMEOUT_S, self._check, self._replies)

    def _went_idle(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self._idle is not None and not self._idle.done():
            self._idle.set_result(None)

    async def idle(self) -> None:
        """Until every command sent has its reply."""
        if self.waiting:
            self._idle = self._loop.create_future()
            await self._idle

    async def close(self) -> None:
        """Write what is waiting, wait for its replies (TIMEOUT_S at most), and close."""
        self.flush()
        try:
            async with asyncio.timeout(TIMEOUT_S):
                await self.idle()
        except TimeoutError:
            pass
        if self.transport is not None:
            self.transport.close()


def retrieved(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()  # looked at, so asyncio does not log it as never retrieved


def resolve(future: asyncio.Future, reply) -> None:
    if future.done():
        return
    if isinstance(reply, Exception):
        future.set_exception(reply)
    else:
        future.set_result(reply)


async def connect(address: dict, context: ssl.SSLContext | None, scripts: tuple[str, ...]) -> tuple[Pipe, dict]:
    """A Pipe to the Redis at `address` (a URL as redis-py's parse_url reads it), signed in, and its database
    selected, with `scripts` loaded: the Pipe, and each script's SHA1 by its text. Within TIMEOUT_S, or RedisError."""
    loop = asyncio.get_running_loop()
    shas = {}
    async with asyncio.timeout(TIMEOUT_S):
        try:
            if "path" in address:  # unix://
                transport, pipe = await loop.create_unix_connection(Pipe, address["path"])
            else:  # redis:// or rediss:// (context is None for the first)
                host = address.get("host", "127.0.0.1")
                transport, pipe = await loop.create_connection(
                    Pipe, host, address.get("port", 6379), ssl=context, server_hostname=context and host
                )
        except OSError as error:
            raise RedisError(f"Redis cannot be reached: {error!r}") from None
        try:
            if address.get("password"):
                auth = [address["password"]]
                if address.get("username"):
                    auth.insert(0, address["username"])
                await pipe.ask("AUTH", *auth)
            if address.get("db"):
                await pipe.ask("SELECT", address["db"])
            for script in scripts:
                shas[script] = await pipe.ask("SCRIPT", "LOAD", script)
        except BaseException:
            transport.close()
            raise
    return pipe, shas
