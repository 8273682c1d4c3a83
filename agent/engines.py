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
import time
from collections import deque
from pathlib import Path

import psutil
import requests

from contracts import engine_args
from contracts import engines as engine_specs
from contracts.credentials import bearer

from . import engine_binary

ENGINES = engine_specs.NAMES
TAIL_LINES = 20
# Where an engine runs from: the agent's own directory, whatever directory the agent was started from.
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
    spec = engine_specs.spec(engine)
    if spec is None:
        raise EngineError(engine_specs.no_such_engine(engine))
    if spec.weights == "first file":
        if weights.is_dir():
            # The first part by name: llama.cpp reads the split count from it and
            # opens the other parts beside it.
            parts = sorted(
                p for p in weights.iterdir() if p.suffix.lower() in spec.reads and not p.name.startswith(".")
            )
            if not parts:
                raise EngineError(f"{weights} holds no {' or '.join(spec.reads)} file for {spec.label}")
            return parts[0]
        return weights
    return weights if weights.is_dir() else weights.parent


def _given(args: list[str]) -> set[str]:
    return {arg.split("=", 1)[0] for arg in args}


def served_name_args(engine: str, model: str, args: list[str]) -> list[str]:
    """The flag that makes the engine serve under the catalog's name, unless the profile names it.

    vLLM answers 404 to a request whose "model" is not its served name, which is
    otherwise the weights' path; the gateway forwards the catalog's name. llama.cpp
    ignores the field, and is told only so that its /v1/models says the same name.
    """
    flags = engine_specs.SPECS[engine].served_name_flags
    if not model or _given(args) & set(flags):
        return []
    return [flags[0], model]


def threads() -> int:
    """The CPUs this agent may use: what llama.cpp is given unless a profile says otherwise.

    llama-server's own default is the physical cores it counts, which inside a container
    or a cgroup limited to fewer is more threads than CPUs, and each token waits on the slowest.
    """
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def threads_args(engine: str, args: list[str]) -> list[str]:
    flags = engine_specs.SPECS[engine].threads_flags
    if not flags or _given(args) & set(flags):
        return []
    return [flags[0], str(threads())]


EMBEDDING_SWITCHES = ("--embedding", "--embeddings")


def pooling_args(weights: Path, args: list[str]) -> list[str]:
    """Mean pooling for an embedding engine on weights whose header names no pooling of its own.

    A chat model's GGUF (llama-shaped) pools nothing, so its engine would answer one
    vector per token, which no OpenAI client reads; a real embedding model (BERT and
    kin) names its pooling, and keeps it. A profile's own --pooling wins.
    """
    if not any(arg in EMBEDDING_SWITCHES for arg in args) or "--pooling" in _given(args):
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


# Always on for llama-server: /metrics is what the agent reads the slots from (docs/engines.md),
# the web UI is not for the gateway's clients, and the prompt cache is what prefix routing
# (gateway/prefix.py) sends a conversation back for: written out rather than left to
# llama-server's defaults, so that a version whose defaults change does not quietly lose it.
LLAMA_SERVER_ALWAYS = ["--metrics", "--no-webui", "--cache-prompt"]
# A request goes to the slot whose cached prompt it shares most with, once it shares at least
# this much (llama-server's own default); a profile's own --slot-prompt-similarity wins.
SLOT_PROMPT_SIMILARITY = "0.10"


def slot_similarity_args(args: list[str]) -> list[str]:
    if _given(args) & {"--slot-prompt-similarity", "-sps"}:
        return []
    return ["--slot-prompt-similarity", SLOT_PROMPT_SIMILARITY]


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
) -> list[str]:
    """The argument list that runs `engine` on `weights`, listening on host:port.

    `model` is the catalog's name for it; empty when a start came from a control
    plane that did not send it, and the engine then serves under its default name.
    """
    refuse_args(engine, args, allow_remote_code)
    target = str(weights_argument(engine, weights))
    named = served_name_args(engine, model, args)
    if engine == "llamacpp":
        server = engine_binary.llama_server(which)
        if server is None:
            raise EngineError(engine_binary.MISSING)
        always = [flag for flag in LLAMA_SERVER_ALWAYS if flag not in args]
        chosen = [
            *threads_args(engine, args),
            *engine_specs.slot_args(engine, 1, args),
            *always,
            *slot_similarity_args(args),
        ]
        pooling = pooling_args(Path(target), args)
        return [server, "--model", target, "--host", host, "--port", str(port), *named, *chosen, *args, *pooling]
    vllm = which("vllm")
    if vllm is None:
        raise EngineError("vllm is not installed on this node (no vllm on PATH)")
    return [vllm, "serve", target, "--host", host, "--port", str(port), *named, *args]


# An engine's environment is made from this list, never from the agent's whole environment:
# an engine runs what its weights make it run (a crafted GGUF that exploits llama-server, a
# vLLM model's own code), and the agent's environment holds the broker's password (REDIS_URL),
# the node's token and whatever else the host gave it. What an engine needs of the host: where
# programs are, the language, which GPUs, its libraries, Hugging Face's offline switches, and
# vLLM's and llama.cpp's (GGML_) own tuning. Not LLAMA_ARG_*: llama-server reads those as
# arguments, around the catalog's allow-list. The supervisor adds, on purpose, HOME and TMPDIR
# (the engine's scratch) and the replica's secret (engine_env); nothing else reaches it.
ENV_PASSED = frozenset(
    {
        "PATH",
        "LANG",
        "LANGUAGE",
        "TZ",
        "LD_LIBRARY_PATH",
        "OMP_NUM_THREADS",
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "HF_DATASETS_OFFLINE",
    }
)
ENV_PASSED_PREFIXES = ("LC_", "CUDA_", "NVIDIA_", "HIP_", "ROCR_", "NCCL_", "VLLM_", "GGML_")
# Keys are set by the supervisor alone: one left in the agent's environment is another replica's.
SECRET_VARIABLES = frozenset(spec.secret_variable for spec in engine_specs.SPECS.values())


def passed(name: str) -> bool:
    """Whether the agent's variable `name` reaches an engine (ENV_PASSED)."""
    return name not in SECRET_VARIABLES and (name in ENV_PASSED or name.startswith(ENV_PASSED_PREFIXES))


def engine_env(engine: str, secret: str = "", scratch: Path | None = None) -> dict[str, str]:
    """The engine's environment: what ENV_PASSED lets through, its scratch as HOME and TMPDIR, its secret.

    The secret in its environment, never argv: a command line is readable by every user of the host.
    """
    env = {name: value for name, value in os.environ.items() if passed(name)}
    if scratch is not None:
        env.update(HOME=str(scratch), TMPDIR=str(scratch))
    if secret and (spec := engine_specs.spec(engine)):
        env[spec.secret_variable] = secret
    return env


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def spawn(
    argv: list[str],
    log_path: Path,
    env: dict[str, str] | None = None,
    *,
    cwd: Path | None = None,
    user: tuple[int, int] | None = None,
) -> subprocess.Popen:
    """Start an engine in its own session, its output appended to `log_path`.

    Its own session, so that it outlives the agent that started it and a signal
    to the agent's terminal does not reach it; the supervisor stops it by group.
    `env` is `engine_env(...)`'s. `user` is (uid, gid) to run it as (agent.fence.engine_user),
    with no other group. The log is opened here, by the agent, readable by the agent alone:
    the engine writes its own through the descriptor it is handed and reads no other's.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "ab") as log:
        log.write(f"\n--- {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {argv!r}\n".encode())
        log.flush()
        switch = {"user": user[0], "group": user[1], "extra_groups": []} if user else {}
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
            cwd=cwd or PROJECT_DIR,
            env=env if env is not None else engine_env(""),
            **switch,
        )


def answers(
    port: int, host: str = "127.0.0.1", timeout: float = 1.0, secret: str = "", engine: str = "llamacpp"
) -> bool:
    """Whether the engine answers its health check (`EngineSpec.health_path`): loaded, not just listening.

    llama-server's /health is 503 while it loads and 200 once it can answer, and is answered
    by its HTTP threads while every slot is busy. With the replica's secret, for an engine
    whose check is behind it (vLLM's /v1/models).
    """
    spec = engine_specs.spec(engine) or engine_specs.LLAMACPP
    try:
        url = f"http://{host}:{port}{spec.health_path}"
        return requests.get(url, timeout=timeout, headers=bearer(secret)).status_code == 200
    except requests.RequestException:
        return False


def wait_until_answers(
    process: subprocess.Popen,
    port: int,
    timeout: float,
    host: str = "127.0.0.1",
    secret: str = "",
    engine: str = "llamacpp",
) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return False
        if answers(port, host, secret=secret, engine=engine):
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
    except PermissionError:
        raise EngineError(
            f"the engine's process group {pid} is another user's (LLMGW_ENGINE_USER): stopping it takes "
            "CAP_KILL, which the agent's unit gives, or root"
        ) from None
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
