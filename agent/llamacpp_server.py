"""PyPI's llama.cpp server, with token usage on the last chunk of a streamed answer.

The gateway counts each API key's tokens from the engine's answer, streamed ones
included, and asks for them with OpenAI's `stream_options: {"include_usage": true}`.
vLLM and the native llama-server honour it; llama-cpp-python's `llama_cpp.server`
accepts the field (its request models ignore unknown fields) but never puts `usage`
into a streamed chunk, so every streamed request on a node without llama-server
would be counted as free.

Run as `python -m agent.llamacpp_server ARGS…` with `llama_cpp.server`'s arguments,
and the replica's secret in `LLMGW_ENGINE_API_KEY` (the server answers 401 without it).
It is that server unchanged, except that the chunk carrying a `finish_reason` of a
streamed completion or chat completion also carries `usage`, with the numbers the
same request reports unstreamed. It is added whether or not `include_usage` was asked
for: the server drops `stream_options` before the model sees the request, the gateway
always asks, and a client that did not ask ignores a field it does not know.

It reaches into llama-cpp-python 0.3's internals: `Llama._create_completion` is a
generator whose frame holds `prompt_tokens` and `completion_tokens`, and chat chunks
are made by `llama_chat_format._convert_text_completion_chunks_to_chat`. If a later
release moves them, the server still runs and streams, without usage, and says so
once in its log. Serving must never depend on this.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Iterator

log = logging.getLogger("llmgw.llamacpp_server")

_warned = False


def _warn_once(message: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        log.warning("%s; streamed answers go without usage", message)


def _is_final(chunk) -> bool:
    try:
        return chunk["choices"][0]["finish_reason"] is not None
    except (KeyError, IndexError, TypeError):
        return False


def _usage_of(generator) -> dict | None:
    """What the suspended `_create_completion` generator has counted so far."""
    frame = generator.gi_frame
    names = frame.f_locals if frame is not None else {}
    if "prompt_tokens" not in names or "completion_tokens" not in names:
        _warn_once("llama_cpp.Llama._create_completion no longer keeps prompt_tokens and completion_tokens")
        return None
    prompt, completion = len(names["prompt_tokens"]), len(names["completion_tokens"])
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _completion_chunks_with_usage(chunks: Iterator[dict]) -> Iterator[dict]:
    for chunk in chunks:
        if _is_final(chunk) and "usage" not in chunk:
            try:
                usage = _usage_of(chunks)
            except Exception as e:  # a count that cannot be read must not end the stream
                _warn_once(f"reading the token counts failed: {e!r}")
                usage = None
            if usage is not None:
                chunk = {**chunk, "usage": usage}
        yield chunk


def _chat_chunks_with_usage(convert, chunks: Iterator[dict]) -> Iterator[dict]:
    """`convert` keeps only the keys it knows; carry `usage` onto the final chat chunk."""
    last: dict = {}

    def remembered():
        for chunk in chunks:
            last["chunk"] = chunk
            yield chunk

    for chat_chunk in convert(remembered()):
        usage = last.get("chunk", {}).get("usage")
        if usage is not None and _is_final(chat_chunk):
            chat_chunk = {**chat_chunk, "usage": usage}
        yield chat_chunk


def install() -> bool:
    """Patch llama-cpp-python in this process; False, with a warning, when its internals differ."""
    from llama_cpp import llama, llama_chat_format

    create = getattr(llama.Llama, "_create_completion", None)
    convert = getattr(llama_chat_format, "_convert_text_completion_chunks_to_chat", None)
    if not inspect.isgeneratorfunction(create) or not inspect.isgeneratorfunction(convert):
        _warn_once("llama-cpp-python's internals are not the ones this shim knows")
        return False

    @functools.wraps(create)
    def create_with_usage(self, *args, **kwargs):
        # Unstreamed, the one item is the whole answer and has its usage already.
        return _completion_chunks_with_usage(create(self, *args, **kwargs))

    llama.Llama._create_completion = create_with_usage
    llama_chat_format._convert_text_completion_chunks_to_chat = functools.partial(_chat_chunks_with_usage, convert)
    return True


POOLING = {"none": 0, "mean": 1, "cls": 2, "last": 3, "rank": 4}


def take_pooling(argv: list[str]) -> tuple[list[str], int | None]:
    """llama-server's `--pooling TYPE`, which PyPI's server has no setting for: taken out of argv."""
    if "--pooling" not in argv:
        return argv, None
    at = argv.index("--pooling")
    if at + 1 >= len(argv) or argv[at + 1] not in POOLING:
        raise SystemExit(f"--pooling takes one of {', '.join(POOLING)}")
    return argv[:at] + argv[at + 2 :], POOLING[argv[at + 1]]


def use_pooling(pooling: int) -> None:
    """Every Llama the server makes pools this way (an embedding model's vectors, one per input)."""
    from llama_cpp import llama

    made = llama.Llama.__init__

    @functools.wraps(made)
    def init(self, *args, **kwargs):
        kwargs.setdefault("pooling_type", pooling)
        made(self, *args, **kwargs)

    llama.Llama.__init__ = init


SECRET = "LLMGW_ENGINE_API_KEY"


def use_secret() -> None:
    """The replica's secret, from the environment the supervisor gave it, as the server's `api_key` setting.

    Never an argument (`--api_key` would put it on the command line every user of the
    host can read); the server's settings read `API_KEY` from the environment. Without
    a secret, an `API_KEY` the agent happened to carry is not taken for one.
    """
    import os

    secret = os.environ.pop(SECRET, "").strip()
    os.environ.pop("API_KEY", None)
    if secret:
        os.environ["API_KEY"] = secret


def main() -> None:
    import sys

    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(name)s: %(message)s")
    from llama_cpp.server.__main__ import main as serve

    use_secret()
    sys.argv, pooling = take_pooling(sys.argv)
    if pooling is not None:
        use_pooling(pooling)
    install()
    serve()


if __name__ == "__main__":
    main()
