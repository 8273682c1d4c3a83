"""Engines as processes: the argument list for each, a free port, and the health check.

Always an argument list, never a shell: a profile's args come from the catalog,
and a shell would make every one of them a place to run something else.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

import psutil
import requests

from contracts import engine_args
from contracts.credentials import bearer

ENGINES = ("llamacpp", "vllm")
TAIL_LINES = 20
# Where `python -m agent.llamacpp_server` finds the agent package, whatever directory
# the agent itself was started from.
PROJECT_DIR = Path(__file__).resolve().parent.parent


class EngineError(Exception):
    """An engine that cannot be started as asked; the message is the sentence to show."""


def refuse_args(engine: str, args: list[str], allow_remote_code: bool) -> None:
    """Refuse any argument not on the engine's allow-list (the contract the catalog checks too).

    Checked again here: what arrives on the node's queue is not trusted for having been stored.
    """
    if problem := engine_args.args_problem(engine, list(args), allow_remote_code):
        raise EngineError(problem)


def weights_argument(engine: str, weights: Path) -> Path:
    """What the engine is handed: llama.cpp the first file of a set, vLLM the directory."""
    if engine == "llamacpp":
        if weights.is_dir():
            # The first part by name: llama.cpp reads the split count from it and
            # opens the other parts beside it.
            parts = sorted(p for p in weights.iterdir() if p.suffix.lower() == ".gguf" and not p.name.startswith("."))
            if not parts:
                raise EngineError(f"{weights} holds no .gguf file for llama.cpp")
            return parts[0]
        return weights
    if engine == "vllm":
        return weights if weights.is_dir() else weights.parent
    raise EngineError(f"no engine called {engine!r}; llmgw runs {' and '.join(ENGINES)}")


# llama-server's flags as llama-cpp-python's server spells them. The catalog is
# written in llama-server's terms (the serve page writes --ctx-size), and a node
# that only has PyPI's server must not fail on a flag it would understand by
# another name. Flags not listed pass through, and the engine says if it objects.
LLAMA_CPP_PYTHON_FLAGS = {
    "--ctx-size": "--n_ctx",
    "-c": "--n_ctx",
    "--n-gpu-layers": "--n_gpu_layers",
    "-ngl": "--n_gpu_layers",
    "--threads": "--n_threads",
    "-t": "--n_threads",
    "--batch-size": "--n_batch",
    "-b": "--n_batch",
    "--ubatch-size": "--n_ubatch",
    "-ub": "--n_ubatch",
    "--chat-template": "--chat_format",
    "--alias": "--model_alias",
    "-a": "--model_alias",
}

# Flags that name the model an engine serves, as a profile may already write them.
SERVED_NAME_FLAGS = {
    "llamacpp": ("--alias", "-a", "--model_alias"),
    "vllm": ("--served-model-name",),
}


# llama-server's switches that PyPI's server takes as a setting with a value.
LLAMA_CPP_PYTHON_SWITCHES = {"--embedding": "--embedding", "--embeddings": "--embedding"}
RERANK_FLAGS = ("--reranking", "--rerank")


def for_llama_cpp_python(args: list[str]) -> list[str]:
    """Profile args in llama-server's spelling, translated for PyPI's `llama_cpp.server`."""
    translated = []
    for arg in args:
        if arg in LLAMA_CPP_PYTHON_SWITCHES:
            translated += [LLAMA_CPP_PYTHON_SWITCHES[arg], "true"]
            continue
        if arg in RERANK_FLAGS:
            # Its server has no rerank endpoint: said before the engine is started, not after.
            raise EngineError(
                "this node's llama.cpp is PyPI's llama-cpp-python, whose server cannot rerank; "
                "a rerank model needs llama.cpp's own llama-server on the node's PATH"
            )
        flag, eq, value = arg.partition("=")
        if flag in LLAMA_CPP_PYTHON_FLAGS:
            flag = LLAMA_CPP_PYTHON_FLAGS[flag]
        translated.append(f"{flag}{eq}{value}")
    return translated


def served_name_args(engine: str, model: str, args: list[str]) -> list[str]:
    """The flag that makes the engine serve under the catalog's name, unless the profile names it.

    vLLM answers 404 to a request whose "model" is not its served name, which is
    otherwise the weights' path; the gateway forwards the catalog's name. llama.cpp
    ignores the field, and is told only so that its /v1/models says the same name.
    """
    if not model or any(arg.split("=", 1)[0] in SERVED_NAME_FLAGS[engine] for arg in args):
        return []
    return ["--served-model-name" if engine == "vllm" else "--alias", model]


def whole_answers_args(args: list[str]) -> list[str]:
    """PyPI's server, told to finish each answer rather than cut it for the next request.

    Its `interrupt_requests` (on by default) ends a running stream with `[DONE]`, no
    finish_reason and no usage, whenever another request is waiting: with two clients
    streaming, nearly every stream was cut. Off, requests take turns on the model's
    lock, each answered whole (docs/engines.md). A profile that sets it keeps its own.
    """
    if any(arg.split("=", 1)[0] == "--interrupt_requests" for arg in args):
        return []
    return ["--interrupt_requests", "false"]


EMBEDDING_SWITCHES = ("--embedding", "--embeddings")


def pooling_args(weights: Path, args: list[str]) -> list[str]:
    """Mean pooling for an embedding engine on weights whose header names no pooling of its own.

    A chat model's GGUF (llama-shaped) pools nothing, so its engine would answer one
    vector per token, which no OpenAI client reads; a real embedding model (BERT and
    kin) names its pooling, and keeps it. A profile's own --pooling wins.
    """
    if not any(arg in EMBEDDING_SWITCHES for arg in args) or any(arg.split("=", 1)[0] == "--pooling" for arg in args):
        return []
    return [] if header_has_pooling(weights) else ["--pooling", "mean"]


def header_has_pooling(weights: Path) -> bool:
    try:
        from gguf import GGUFReader  # in requirements/node.txt; the tests' and a node's environment have it
    except ImportError:
        return False
    try:
        fields = GGUFReader(weights, "r").fields
    except Exception:  # gguf's reader fails a short or foreign file with whatever it trips on
        return False
    return any(name.endswith(".pooling_type") for name in fields)


def command(
    engine: str,
    weights: Path,
    port: int,
    args: list[str],
    *,
    model: str = "",
    host: str = "127.0.0.1",
    allow_remote_code: bool = False,
    which=shutil.which,
    python: str = sys.executable,
) -> list[str]:
    """The argument list that runs `engine` on `weights`, listening on host:port.

    `model` is the catalog's name for it; empty when a start came from a control
    plane that did not send it, and the engine then serves under its default name.
    """
    refuse_args(engine, args, allow_remote_code)
    target = str(weights_argument(engine, weights))
    named = served_name_args(engine, model, args)
    if engine == "llamacpp":
        args = [*args, *pooling_args(Path(target), args)]
        server = which("llama-server")
        # The native server when installed; PyPI's llama-cpp-python otherwise, through
        # the shim that gives its streamed answers the usage the gateway counts.
        if server:
            return [server, "--model", target, "--host", host, "--port", str(port), *named, *args]
        return [
            *[python, "-m", "agent.llamacpp_server"],
            *["--model", target, "--host", host, "--port", str(port)],
            *for_llama_cpp_python([*named, *args]),
            *whole_answers_args(args),
        ]
    vllm = which("vllm")
    if vllm is None:
        raise EngineError("vllm is not installed on this node (no vllm on PATH)")
    return [vllm, "serve", target, "--host", host, "--port", str(port), *named, *args]


# Where each engine reads its API key from its environment: PyPI's server through our
# shim (which hands it to the server's `api_key` setting), llama-server's --api-key,
# vLLM's --api-key. Never argv: a command line is readable by every user of the host.
SHIM_SECRET = "LLMGW_ENGINE_API_KEY"
SECRET_VARIABLES = {"llamacpp": (SHIM_SECRET, "LLAMA_API_KEY"), "vllm": ("VLLM_API_KEY",)}
# What an engine must not inherit from the agent: the node's token (an engine runs
# code from the catalog, remote code included) and any key meant for another engine.
WITHHELD = {"LLMGW_NODE_TOKEN", "API_KEY", SHIM_SECRET, "LLAMA_API_KEY", "LLAMA_ARG_API_KEY", "VLLM_API_KEY"}


def engine_env(engine: str, secret: str = "") -> dict[str, str]:
    """The engine's environment: the agent's, less the node's token, with the replica's secret where it reads it."""
    env = {name: value for name, value in os.environ.items() if name not in WITHHELD}
    if secret:
        env.update(dict.fromkeys(SECRET_VARIABLES.get(engine, ()), secret))
    return env


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def spawn(argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start an engine in its own session, its output appended to `log_path`.

    Its own session, so that it outlives the agent that started it and a signal
    to the agent's terminal does not reach it; the supervisor stops it by group.
    `env` is `engine_env(...)`'s; by default the agent's, less what an engine must not see.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(f"\n--- {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {argv!r}\n".encode())
        log.flush()
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
            cwd=PROJECT_DIR,
            env=env if env is not None else engine_env(""),
        )


def answers(port: int, host: str = "127.0.0.1", timeout: float = 1.0, secret: str = "") -> bool:
    """Whether the engine answers its models endpoint: loaded, not just listening.

    With the replica's secret: an engine locked to the gateway answers no one else.
    """
    try:
        return (
            requests.get(f"http://{host}:{port}/v1/models", timeout=timeout, headers=bearer(secret)).status_code == 200
        )
    except requests.RequestException:
        return False


def wait_until_answers(
    process: subprocess.Popen, port: int, timeout: float, host: str = "127.0.0.1", secret: str = ""
) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return False
        if answers(port, host, secret=secret):
            return True
        time.sleep(0.2)
    return False


def last_lines(log_path: Path, lines: int = TAIL_LINES) -> str:
    """The end of an engine's output: what a report of its death carries."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 64 * 1024))
            tail = deque(f.read().decode("utf-8", "replace").splitlines(), maxlen=lines)
    except OSError:
        return ""
    return "\n".join(tail)


def stop_group(pid: int, grace: float = 10.0) -> None:
    """SIGTERM the engine's process group, then SIGKILL what is left after `grace` seconds."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not group_alive(pid):
            return
        time.sleep(0.1)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie still answers signal 0; it is dead for our purposes, and so is a group of them.
    return _running(pgid) or any(_running(p.pid) for p in psutil.process_iter() if _group_of(p.pid) == pgid)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _group_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def start_time(pid: int) -> int | None:
    """When the process started, in clock ticks since boot: with the pid, who it is.

    A pid alone may have been reused since it was recorded; the pair cannot be.
    The command line is no help either: an interpreter's script shows up under
    the interpreter's name. Read from /proc rather than psutil's create_time(),
    which follows the wall clock: an NTP step would make a running engine a stranger.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])
