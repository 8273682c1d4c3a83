"""A lean HTTP/1.1 load generator for bench/gateway.py: raw asyncio and httptools, kept-alive connections.

Kept as light as it can be: on two shared cores whatever the load generator spends is
taken from the server it measures. Every target gets the same client, so what it does
cost falls out of the differences.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field

import httptools
from harness import pct, rotation

__all__ = [
    "Concurrent",
    "Connection",
    "OpenStreams",
    "Sequential",
    "Target",
    "answers",
    "concurrent",
    "open_streams",
    "pct",
    "release_held",
    "sequential",
]


@dataclass
class Target:
    name: str
    port: int
    key: str = "x"
    model: str = "stub"
    hold_model: str = "stub-hold"
    path: str = "/v1/chat/completions"
    pid: int | None = None  # the server's process group, for its CPU time and memory

    def payload(self, stream: bool, hold: bool) -> dict:
        """The request's JSON: a chat completion; a target of another endpoint overrides this alone."""
        payload = {
            "model": self.hold_model if hold else self.model,
            "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 20,
        }
        if stream:
            payload["stream"] = True
            payload["stream_options"] = {"include_usage": True}
        return payload

    def request(self, stream: bool = False, hold: bool = False) -> bytes:
        body = json.dumps(self.payload(stream, hold)).encode()
        head = (
            f"POST {self.path} HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\n"
            f"Authorization: Bearer {self.key}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        return head.encode() + body


@dataclass
class Response:
    status: int = 0
    started: float = 0.0
    first_event: float | None = None  # when the first `data:` of a stream arrived
    finished: float = 0.0
    server_timing: bytes = b""
    tail: bytes = b""
    has_usage: bool = False

    @property
    def seconds(self) -> float:
        return self.finished - self.started

    @property
    def ok(self) -> bool:
        return self.status == 200 and (b"[DONE]" in self.tail or self.has_usage)


class Connection(asyncio.Protocol):
    """One kept-alive connection; one request at a time on it."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.done: asyncio.Future | None = None
        self.first: asyncio.Future | None = None
        self.lost = False

    @classmethod
    async def open(cls, port: int) -> Connection:
        _, connection = await asyncio.get_running_loop().create_connection(cls, "127.0.0.1", port)
        return connection

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.first is not None and not self.first.done():
            self.first.set_result(None)  # no first event: it will not come now
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError("connection closed"))

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            pass
        except httptools.HttpParserError as exc:
            if self.done is not None and not self.done.done():
                self.done.set_exception(ConnectionError(str(exc)))
            self.transport.close()

    def on_status(self, status: bytes) -> None:
        self.response.status = self.parser.get_status_code()

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"server-timing":
            self.response.server_timing = value

    def on_body(self, body: bytes) -> None:
        response = self.response
        if response.first_event is None and b"data:" in body:
            response.first_event = time.perf_counter()
            if self.first is not None and not self.first.done():
                self.first.set_result(response)
        if not response.has_usage and b'"usage"' in body:
            response.has_usage = True
        response.tail = (response.tail + body)[-64:]

    def on_message_complete(self) -> None:
        self.response.finished = time.perf_counter()
        if self.first is not None and not self.first.done():
            self.first.set_result(self.response)
        self.done.set_result(self.response)

    def send(self, raw: bytes) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        self.response = Response()
        self.done = loop.create_future()
        self.first = loop.create_future()
        self.response.started = time.perf_counter()
        self.transport.write(raw)
        return self.done

    def close(self) -> None:
        if self.done is not None and not self.done.done():
            self.done.cancel()  # nobody waits for it now
        self.transport.close()


def cpu_and_rss(pgid: int | None) -> tuple[float, int]:
    """CPU seconds and resident bytes of every process in a process group (a server and its workers)."""
    if pgid is None:
        return 0.0, 0
    import os

    tick = os.sysconf("SC_CLK_TCK")
    page = os.sysconf("SC_PAGE_SIZE")
    cpu, rss = 0.0, 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # field 5, pgrp, counted after the command name
            cpu += (int(fields[11]) + int(fields[12])) / tick
            rss += int(fields[21]) * page
    return cpu, rss


async def answers(target: Target, timeout: float = 60) -> bool:
    """Until a chat completion through `target` comes back 200 (routes and workers take a moment)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        try:
            connection = await Connection.open(target.port)
            response = await asyncio.wait_for(connection.send(target.request()), 10)
            connection.close()
            if response.ok:
                return True
        except (TimeoutError, OSError, ConnectionError):
            pass
        await asyncio.sleep(0.3)
    return False


async def release_held(stub_port: int) -> None:
    """bench/stub_upstream.py lets every stream it holds go."""
    connection = await Connection.open(stub_port)
    raw = b"POST /release HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\n\r\n"
    await connection.send(raw)
    connection.close()


# --- the measures ---------------------------------------------------------------------------


@dataclass
class Sequential:
    """One request at a time on one kept-alive connection per target, the targets taking turns."""

    seconds: dict[str, list[float]] = field(default_factory=dict)
    first_event: dict[str, list[float]] = field(default_factory=dict)
    gateway_ms: dict[str, list[float]] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)


async def sequential(targets: list[Target], rounds: int, stream: bool, warmup: int = 50) -> Sequential:
    result = Sequential()
    connections = {t.name: await Connection.open(t.port) for t in targets}
    raws = {t.name: t.request(stream=stream) for t in targets}
    for t in targets:
        result.seconds[t.name], result.first_event[t.name], result.gateway_ms[t.name] = [], [], []
        result.errors[t.name] = 0
    for index in range(warmup + rounds):
        for t in rotation(targets, index):
            connection = connections[t.name]
            if connection.lost:
                connection = connections[t.name] = await Connection.open(t.port)
            try:
                response = await asyncio.wait_for(connection.send(raws[t.name]), 30)
            except (TimeoutError, ConnectionError):
                result.errors[t.name] += 1
                connection.close()
                continue
            if index < warmup:
                continue
            if not response.ok:
                result.errors[t.name] += 1
                continue
            result.seconds[t.name].append(response.seconds)
            if response.first_event is not None:
                result.first_event[t.name].append(response.first_event - response.started)
            if response.server_timing:
                result.gateway_ms[t.name].append(_server_timing_ms(response.server_timing))
    for connection in connections.values():
        connection.close()
    return result


def _server_timing_ms(value: bytes) -> float:
    for part in value.decode().split(","):
        for item in part.split(";"):
            if item.strip().startswith("dur="):
                return float(item.strip()[4:])
    return float("nan")


@dataclass
class Concurrent:
    requests_per_second: float
    seconds: list[float]
    errors: int
    cpu_seconds: float  # the server's, over the measured time
    also_cpu_seconds: float = 0.0  # the processes named in `also` (say, a Redis it uses), over the same time


async def concurrent(
    target: Target, clients: int, duration: float, warmup: float = 1.0, also: int | None = None
) -> Concurrent:
    """`clients` connections, each sending the next request as soon as its last one is answered.

    `also`: another process group whose CPU over the measured time is counted apart.
    """
    raw = target.request()
    connections = [await Connection.open(target.port) for _ in range(clients)]
    seconds: list[float] = []
    errors = 0
    loop = asyncio.get_running_loop()
    start = loop.time()
    measure_from, stop_at = start + warmup, start + warmup + duration
    counted = 0
    cpu_at_start = None
    also_at_start = 0.0

    async def client(index: int) -> None:
        nonlocal errors, counted
        connection = connections[index]
        while loop.time() < stop_at:
            if connection.lost:
                connection = connections[index] = await Connection.open(target.port)
            try:
                response = await asyncio.wait_for(connection.send(raw), 60)
            except (TimeoutError, ConnectionError):
                errors += 1
                connection.close()
                continue
            now = loop.time()
            if measure_from <= now <= stop_at:
                counted += 1
                if response.ok:
                    seconds.append(response.seconds)
                else:
                    errors += 1

    async def mark_cpu() -> None:
        nonlocal cpu_at_start, also_at_start
        await asyncio.sleep(warmup)
        cpu_at_start = cpu_and_rss(target.pid)[0]
        also_at_start = cpu_and_rss(also)[0]

    marker = asyncio.ensure_future(mark_cpu())
    await asyncio.gather(*(client(i) for i in range(clients)))
    cpu_at_stop = cpu_and_rss(target.pid)[0]
    also_at_stop = cpu_and_rss(also)[0]
    await marker
    for connection in connections:
        connection.close()
    return Concurrent(
        counted / duration, seconds, errors, cpu_at_stop - (cpu_at_start or 0.0), also_at_stop - also_at_start
    )


@dataclass
class OpenStreams:
    asked: int
    held: int  # streams whose first event arrived and that stayed open
    completed: int  # of those, how many ran to [DONE] once the upstream let them go
    answer_ms: float | None  # a plain request's time through the target while the streams are held
    rss_bytes: int


async def open_streams(target: Target, count: int, release, wait: float = 30.0, batch: int = 100) -> OpenStreams:
    """Opens `count` streams that the stub holds after their first event, counts those held, then lets them go."""
    raw = target.request(stream=True, hold=True)
    connections: list[Connection] = []
    firsts: list[asyncio.Future] = []
    dones: list[asyncio.Future] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait
    for start in range(0, count, batch):
        opened = await asyncio.gather(
            *(Connection.open(target.port) for _ in range(min(batch, count - start))), return_exceptions=True
        )
        for connection in opened:
            if isinstance(connection, Exception):
                continue
            connections.append(connection)
            dones.append(connection.send(raw))
            firsts.append(connection.first)
        await asyncio.sleep(0.05)
    remaining = max(1.0, deadline - loop.time())
    await asyncio.wait(firsts, timeout=remaining)
    held = sum(1 for c, f in zip(connections, firsts, strict=True) if f.done() and f.result() and not c.lost)

    # Is the target still answering while it holds them?
    answer = []
    probe = await Connection.open(target.port)
    for _ in range(10):
        try:
            response = await asyncio.wait_for(probe.send(target.request()), 10)
        except (ConnectionError, TimeoutError):
            break
        if response.ok:
            answer.append(response.seconds)
    probe.close()
    rss = cpu_and_rss(target.pid)[1]

    await release()
    await asyncio.wait(dones, timeout=wait)
    completed = sum(1 for d in dones if d.done() and not d.cancelled() and not d.exception() and d.result().ok)
    for future in dones:
        if future.done() and not future.cancelled():
            future.exception()  # retrieved, so asyncio does not log it
    for connection in connections:
        connection.close()
    await asyncio.sleep(0.5)
    return OpenStreams(count, held, completed, statistics.median(answer) * 1000 if answer else None, rss)
