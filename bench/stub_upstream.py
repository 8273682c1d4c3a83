#!/usr/bin/env python
"""A minimal OpenAI-compatible upstream for bench/gateway.py, as cheap per request as it can be.

    .venv/bin/python bench/stub_upstream.py --port 8199

Raw asyncio on uvloop with httptools' parser, so that the upstream costs the shared
CPU as little as possible and the proxies in front of it are what is measured:

  POST /v1/chat/completions   answers at once: a chat.completion with a `usage` object, or
                              with "stream": true 20 chat.completion.chunk events, a usage
                              chunk if stream_options.include_usage, then `data: [DONE]`
  GET  /v1/models             the one model, named by --model
  POST /release               ends every held stream (below) and answers how many it ended

A streaming request for a model whose name contains "hold" gets its headers and first
chunk at once and the rest only after POST /release: that is how the benchmark keeps
up to 1,000 streams open through a proxy and counts how many the proxy holds.
"""

from __future__ import annotations

import argparse
import asyncio
import json

import httptools
import uvloop

CHUNKS = 20

_held: asyncio.Event | None = None
_held_count = 0


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _event(payload: dict) -> bytes:
    return _chunk(b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")


def _completion(model: str) -> bytes:
    body = json.dumps(
        {
            "id": "chatcmpl-stub",
            "object": "chat.completion",
            "created": 1700000000,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "tok " * CHUNKS},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 8, "completion_tokens": CHUNKS, "total_tokens": 8 + CHUNKS},
        },
        separators=(",", ":"),
    ).encode()
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


def _stream(model: str, include_usage: bool) -> list[bytes]:
    """The stream as its pieces: headers and the first chunk, then the rest."""
    base = {"id": "chatcmpl-stub", "object": "chat.completion.chunk", "created": 1700000000, "model": model}
    pieces = [b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"]
    for i in range(CHUNKS):
        delta = {"role": "assistant", "content": "tok "} if i == 0 else {"content": "tok "}
        finish = "stop" if i == CHUNKS - 1 else None
        pieces.append(_event(dict(base, choices=[{"index": 0, "delta": delta, "finish_reason": finish}])))
    if include_usage:
        usage = {"prompt_tokens": 8, "completion_tokens": CHUNKS, "total_tokens": 8 + CHUNKS}
        pieces.append(_event(dict(base, choices=[], usage=usage)))
    pieces.append(_chunk(b"data: [DONE]\n\n"))
    pieces.append(b"0\r\n\r\n")
    return [pieces[0] + pieces[1], b"".join(pieces[2:])]


_cache: dict[tuple, bytes | list[bytes]] = {}


def _answer(key: tuple, make) -> bytes | list[bytes]:
    if key not in _cache:
        _cache[key] = make()
    return _cache[key]


def _json_response(status: str, payload: dict) -> bytes:
    body = json.dumps(payload).encode()
    return b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
        status.encode(),
        len(body),
        body,
    )


class Upstream(asyncio.Protocol):
    model_name = "stub"

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body: list[bytes] = []

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        url, body = self.url, b"".join(self.body)
        self.url, self.body = b"", []
        method = self.parser.get_method()
        keep_alive = self.parser.should_keep_alive()
        if method == b"POST" and url.endswith(b"/chat/completions"):
            request = json.loads(body or b"{}")
            model = request.get("model", "stub")
            if request.get("stream"):
                include_usage = bool((request.get("stream_options") or {}).get("include_usage"))
                pieces = _answer(("stream", model, include_usage), lambda: _stream(model, include_usage))
                if "hold" in model:
                    asyncio.get_running_loop().create_task(self._held(pieces, keep_alive))
                    return
                self.transport.write(pieces[0] + pieces[1])
            else:
                self.transport.write(_answer(("json", model), lambda: _completion(model)))
        elif method == b"GET" and url.endswith(b"/models"):
            self.transport.write(
                _json_response(
                    "200 OK",
                    {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "stub"}]},
                )
            )
        elif method == b"POST" and url == b"/release":
            self.transport.write(_json_response("200 OK", {"released": _release()}))
        else:
            self.transport.write(_json_response("404 Not Found", {"error": {"message": "not here"}}))
        if not keep_alive:
            self.transport.close()

    async def _held(self, pieces: list[bytes], keep_alive: bool) -> None:
        global _held, _held_count
        if _held is None:
            _held = asyncio.Event()
        event = _held
        _held_count += 1
        self.transport.write(pieces[0])
        await event.wait()
        if not self.transport.is_closing():
            self.transport.write(pieces[1])
            if not keep_alive:
                self.transport.close()


def _release() -> int:
    global _held, _held_count
    released = _held_count
    if _held is not None:
        _held.set()
    _held, _held_count = None, 0
    return released


async def serve(host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Upstream, host, port, backlog=4096)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8199)
    parser.add_argument("--model", default="stub")
    args = parser.parse_args()
    Upstream.model_name = args.model
    uvloop.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
