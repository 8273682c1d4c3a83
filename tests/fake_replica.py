"""A replica the tests can steer: a real HTTP server speaking the OpenAI API, in a thread.

The real engine (llama.cpp) is what the end-to-end test uses. This one is for
what a real engine cannot be made to do on cue: hold a stream open until told,
say when its client hung up, answer a precise usage. It is a real server on a
real socket, so the gateway under test cannot tell it from an engine.
"""

from __future__ import annotations

import asyncio
import json
import threading

from aiohttp import web

from .services import free_port

# The body keys that steer it ("hold", "delay", ...): its own engine keys, which a gateway passes
# on only when its operator allows them (LLMGW_GATEWAY_ENGINE_KEYS), as the tests' gateways do.
STEERING_KEYS = ("hold", "hold_after", "delay", "gap")


class FakeReplica:
    def __init__(self, name: str = "fake") -> None:
        self.name = name
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}/v1"
        self.requests: list[dict] = []  # bodies as received
        self.paths: list[str] = []
        self.open_streams = 0
        self.hung_up = 0  # streams whose client went away before the end
        self.release = threading.Event()  # lets held streams finish
        self.headers: list = []  # each request's headers (case-insensitive), as the engine saw them
        self.usage = {"prompt_tokens": 11, "completion_tokens": 3}
        self.chunks = 3
        # Steering: answer with this status and an OpenAI error instead (429: a replica out of room),
        # or with a call of this tool, {"name": ..., "arguments": "{...}"}, as an engine calls tools.
        self.status = 200
        self.tool_call: dict | None = None
        self.hold = False  # hold every stream after its first chunk, as "hold": true in a body does
        # Close the connection without a word on this many of the next requests, as an engine does
        # that closes a kept-alive connection just as the gateway sends on it.
        self.drop_next = 0
        self.dropped = 0
        self.stop_reason: str | None = None  # vLLM names the stop sequence that ended an answer here
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._started.wait(10)

    # --- how it answers ------------------------------------------------------

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if self.drop_next > 0:
            self.drop_next -= 1
            self.dropped += 1
            request.transport.close()
            return web.Response()
        self.requests.append(body)
        self.headers.append(request.headers.copy())
        self.paths.append(request.path)
        if body.get("delay"):
            await asyncio.sleep(body["delay"])
        if self.status != 200:
            error = {"message": f"the replica answers {self.status}", "type": "rate_limit_error", "code": None}
            return web.json_response({"error": error}, status=self.status)
        if self.tool_call is not None:
            return await self._call_tool(request, body)
        if not body.get("stream") and body.get("hold"):
            return await self._held_whole(request, body)
        if not body.get("stream"):
            return web.json_response(
                {
                    "object": "chat.completion",
                    "model": body.get("model"),
                    "replica": self.name,
                    "usage": self.usage,
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": "ok"},
                            "finish_reason": "stop",
                            "stop_reason": self.stop_reason,
                        }
                    ],
                }
            )
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        self.open_streams += 1
        try:
            for i in range(self.chunks):
                chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": f"c{i}"}}]}
                await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                if body.get("gap"):
                    await asyncio.sleep(body["gap"])  # an engine's pace: a chunk every `gap` seconds
                if i == (0 if body.get("hold") or self.hold else body.get("hold_after")):
                    # Wait here, with this chunk sent (the first, or the one asked for), until the test lets go.
                    while not self.release.is_set():
                        await asyncio.sleep(0.02)
                        if request.transport is None or request.transport.is_closing():
                            raise ConnectionResetError
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {"object": "chat.completion.chunk", "choices": [], "usage": self.usage}
                await response.write(b"data: " + json.dumps(usage).encode() + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            self.hung_up += 1
            raise
        finally:
            self.open_streams -= 1
        return response

    async def _held_whole(self, request: web.Request, body: dict) -> web.StreamResponse:
        """A whole (not streamed) answer begun and held until released, as a slow engine's answer is in transit."""
        whole = json.dumps({"object": "chat.completion", "model": body.get("model"), "usage": self.usage}).encode()
        response = web.StreamResponse(headers={"Content-Type": "application/json", "Content-Length": str(len(whole))})
        await response.prepare(request)
        await response.write(whole[:10])
        try:
            while not self.release.is_set():
                await asyncio.sleep(0.02)
                if request.transport is None or request.transport.is_closing():
                    raise ConnectionResetError
        except (ConnectionResetError, asyncio.CancelledError):
            self.hung_up += 1
            raise
        await response.write(whole[10:])
        await response.write_eof()
        return response

    async def _call_tool(self, request: web.Request, body: dict) -> web.StreamResponse:
        call = {"id": "call_1", "type": "function", "function": self.tool_call}
        if not body.get("stream"):
            message = {"role": "assistant", "content": None, "tool_calls": [call]}
            choice = {"index": 0, "message": message, "finish_reason": "tool_calls"}
            return web.json_response({"object": "chat.completion", "usage": self.usage, "choices": [choice]})
        # Streamed as llama.cpp and vLLM do: the name first, then the arguments in pieces.
        arguments = self.tool_call["arguments"]
        half = len(arguments) // 2
        deltas = [
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": self.tool_call["name"], "arguments": ""},
                    }
                ]
            },
            {"tool_calls": [{"index": 0, "function": {"arguments": arguments[:half]}}]},
            {"tool_calls": [{"index": 0, "function": {"arguments": arguments[half:]}}]},
        ]
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for n, delta in enumerate(deltas):
            choice = {"index": 0, "delta": delta, "finish_reason": "tool_calls" if n == len(deltas) - 1 else None}
            chunk = {"object": "chat.completion.chunk", "choices": [choice]}
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        usage = {"object": "chat.completion.chunk", "choices": [], "usage": self.usage}
        await response.write(b"data: " + json.dumps(usage).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": []})

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/rerank"):
            app.router.add_post(path, self._answer)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, handle_signals=False)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        self._started.set()
        self._loop.run_forever()

    def stop(self) -> None:
        self.release.set()
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
