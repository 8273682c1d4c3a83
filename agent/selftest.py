"""Proof that an engine runs on this host before the node says it has one.

An engine that is installed is not an engine that works. llama.cpp built with
`-march=native` on a CPU that reports AMX (which a process here cannot use) loads
a model and then dies with SIGILL on its first token of a Q4/Q8 model; an engine
built on one host, or taken from a shared wheel cache, may run instructions
another host lacks. Found only when a replica starts, that takes replicas down
one by one, each crash looking like the model's fault.

So on start and on each re-probe the agent starts every engine it found, the way
the supervisor starts it (`engines.command`, `engines.spawn`: a child process in
its own session), on a tiny quantized model, asks for one token, and gives it a
timeout. An engine that crashes, exits or hangs is reported as installed but
unusable, with the sentence saying why, and left out of the engines placement
reads. A verdict of "works" is kept while the engine's files stay the same; one
of "does not work" is tested again at every re-probe, since a hang may have been
a moment of load.
"""

from __future__ import annotations

import atexit
import importlib.util
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import requests

from contracts import tiny_gguf

from . import engine_binary, engines

log = logging.getLogger(__name__)


def _timeout_from_env() -> float:
    try:
        return max(1.0, float(os.environ.get("LLMGW_SELFTEST_TIMEOUT_S", "") or 60))
    except ValueError:
        return 60.0


# Loading the 300 KB model and one token take about 2 s; the rest is room for a busy host.
TIMEOUT_S = _timeout_from_env()
ENGINE_NAMES = {"llamacpp": "llama.cpp", "vllm": "vLLM"}
MODEL_NAME = "selftest-q4_0-q8_0.gguf"

# Engine -> the fingerprint of its files, for engines proven to work in this process.
_proven: dict[str, tuple] = {}
# Self-test engines running now. Each runs in its own session, as every engine does, so
# an agent stopped in the middle of a self-test (one that hangs, say) would leave it behind.
_running: set[int] = set()


@atexit.register
def stop_running() -> None:
    for pid in list(_running):
        engines.stop_group(pid, grace=2)


# --- the model ----------------------------------------------------------------------

CONTEXT = tiny_gguf.CONTEXT


def write_quantized_llama(path: Path) -> Path:
    """A llama-shaped GGUF of a few hundred KB whose matrices are Q4_0 and Q8_0.

    Those are the types that take llama.cpp's quantized kernels (AMX among them,
    where a build turns it on): the F32 test model never reaches them, which is how
    a build that crashes on every real model passed every test. Every matrix is
    32 wide or a multiple of it, as those kernels need. Written to a temporary name
    and renamed, so a second agent never loads half of it. contracts.tiny_gguf writes
    it, as it writes the demo model.
    """
    return tiny_gguf.write_llama(path, "llmgw-selftest", seed=4321, layer_types=("Q4_0", "Q8_0"))[0]


def selftest_model(workdir: Path) -> Path:
    path = Path(workdir) / MODEL_NAME
    if not path.is_file():
        write_quantized_llama(path)
    return path


# --- the tests ----------------------------------------------------------------------


def _crash_sentence(engine: str, code: int) -> str:
    name = ENGINE_NAMES.get(engine, engine)
    try:
        signame = signal.Signals(-code).name
    except ValueError:
        signame = f"signal {-code}"
    if signame == "SIGILL":
        return (
            f"{name} crashed with SIGILL on this CPU: it was built for instructions this CPU cannot run "
            "(rebuild it on this host with scripts/build-engine.sh)"
        )
    return f"{name} crashed with {signame} in its self-test"


def _ended_sentence(engine: str, code: int, log_path: Path) -> str:
    if code < 0:
        return _crash_sentence(engine, code)
    tail = engines.last_lines(log_path, 3).strip().splitlines()
    said = f": {tail[-1][:300]}" if tail else ""
    return f"{ENGINE_NAMES.get(engine, engine)} exited with code {code} in its self-test{said}"


def _exit_code(process: subprocess.Popen, wait: float) -> int | None:
    try:
        return process.wait(timeout=wait)
    except subprocess.TimeoutExpired:
        return None


def check_llamacpp(
    workdir: Path,
    timeout: float = TIMEOUT_S,
    which: Callable[[str], str | None] = shutil.which,
) -> str | None:
    """None when llama.cpp's llama-server loads a quantized model and generates a token; else the sentence why not."""
    workdir = Path(workdir)
    model = selftest_model(workdir)
    port = engines.free_port()
    try:
        argv = engines.command("llamacpp", model, port, ["--ctx-size", str(CONTEXT)], which=which)
    except engines.EngineError as error:
        return str(error)
    log_path = workdir / "llamacpp.log"
    log_path.unlink(missing_ok=True)  # its last lines must be this run's
    deadline = time.monotonic() + timeout
    # A secret of its own, as every engine on a node has: the self-test engine answers no one else either.
    secret = secrets.token_urlsafe(32)
    process = engines.spawn(argv, log_path, engines.engine_env("llamacpp", secret))
    _running.add(process.pid)
    try:
        if not engines.wait_until_answers(process, port, timeout, secret=secret, engine="llamacpp"):
            code = process.poll()
            if code is not None:
                return _ended_sentence("llamacpp", code, log_path)
            return f"llama.cpp did not load its self-test model within {timeout:.0f} s"
        try:
            answer = requests.post(
                f"http://127.0.0.1:{port}/v1/completions",
                json={"prompt": "Hello", "max_tokens": 1, "temperature": 0},
                headers=engines.bearer(secret),
                timeout=max(1.0, deadline - time.monotonic()),
            )
        except requests.Timeout:
            return f"llama.cpp did not generate a token within {timeout:.0f} s in its self-test"
        except requests.RequestException:
            answer = None
        # A crash on the first token ends the process as it answers, or instead of answering.
        code = _exit_code(process, 2.0 if answer is None else 0.2)
        if code is not None:
            return _ended_sentence("llamacpp", code, log_path)
        if answer is None:
            return "llama.cpp dropped the connection of its self-test without an answer"
        if answer.status_code != 200:
            return f"llama.cpp answered its self-test with HTTP {answer.status_code}: {answer.text[:300]}"
        return None
    finally:
        engines.stop_group(process.pid, grace=5)
        _exit_code(process, 5)
        _running.discard(process.pid)


def check_vllm(timeout: float = TIMEOUT_S, which=shutil.which, python: str = sys.executable) -> str | None:
    """vLLM cannot serve without a GPU and weights in safetensors; it must at least run."""
    binary = which("vllm")
    argv = [binary, "--version"] if binary else [python, "-c", "import vllm"]
    try:
        done = subprocess.run(
            argv,
            capture_output=True,
            timeout=timeout,
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            env=engines.engine_env("vllm"),  # an engine's environment, not the agent's (engines.ENV_PASSED)
        )
    except subprocess.TimeoutExpired:
        return f"vLLM did not start within {timeout:.0f} s in its self-test"
    except OSError as error:
        return f"vLLM could not be run: {error.strerror}"
    if done.returncode < 0:
        return _crash_sentence("vllm", done.returncode)
    if done.returncode != 0:
        tail = done.stderr.decode(errors="replace").strip().splitlines()
        said = f": {tail[-1][:300]}" if tail else ""
        return f"vLLM exited with code {done.returncode} in its self-test{said}"
    return None


def fingerprint(engine: str, which=shutil.which) -> tuple:
    """What changes when the engine is installed, upgraded or rebuilt: its files' sizes and times."""
    paths: list[Path] = []
    binary = engine_binary.llama_server(which) if engine == "llamacpp" else which("vllm")
    if binary:
        # Resolved: `make engine` switches a link between builds for two instruction-set mixes.
        paths.append(Path(binary).resolve())
    if engine == "vllm":
        try:
            spec = importlib.util.find_spec("vllm")
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.origin:
            paths.append(Path(spec.origin))
    marks = []
    for path in paths:
        try:
            stat = path.stat()
        except OSError:
            continue
        marks.append((str(path), stat.st_size, stat.st_mtime_ns))
    return tuple(marks)


def unusable(found: list[str], workdir: Path, timeout: float = TIMEOUT_S) -> dict[str, str]:
    """{engine: why it cannot be used} for the engines found that fail their self-test."""
    verdicts: dict[str, str] = {}
    for engine in found:
        mark = fingerprint(engine)
        if _proven.get(engine) == mark:
            continue
        started = time.monotonic()
        try:
            if engine == "llamacpp":
                reason = check_llamacpp(workdir, timeout)
            elif engine == "vllm":
                reason = check_vllm(timeout)
            else:
                reason = None
        except Exception as error:  # a self-test that cannot even run proves nothing works
            log.exception("the self-test of %s could not run", engine)
            reason = f"{ENGINE_NAMES.get(engine, engine)}'s self-test could not run: {error}"
        if reason is None:
            _proven[engine] = mark
            log.info("%s passed its self-test in %.1f s", ENGINE_NAMES.get(engine, engine), time.monotonic() - started)
        else:
            _proven.pop(engine, None)
            verdicts[engine] = reason
            log.warning("%s is installed but unusable: %s", ENGINE_NAMES.get(engine, engine), reason)
    return verdicts
