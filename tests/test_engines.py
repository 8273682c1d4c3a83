"""Engines on a node: argument lists, and a real llama.cpp started, killed and brought back.

llama.cpp runs for real (llama.cpp's llama-server, as `make engine` builds it) on a tiny GGUF the tests write.
vLLM needs a GPU, so its launch is tested with a stand-in: a small script named
`vllm` on PATH that records its arguments and answers /v1/models like an engine.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
import requests
from django.conf import settings

from agent import engine_state, engines, supervisor
from agent.engine_tasks import start_on_node
from launcher.demo_model import EOS_TOKEN_ID

from .support.engines import Reports, step_until
from .support.processes import node_env
from .support.waiting import wait_until

BASE_DIR = Path(__file__).resolve().parent.parent


# --- argument lists ------------------------------------------------------------


def no_llama_server(name):
    return None


LLAMA_SERVER = "/usr/bin/llama-server"


def on_path(name):
    return LLAMA_SERVER if name == "llama-server" else None


def test_llamacpp_runs_llama_server_on_the_first_file_of_a_set_with_its_threads_one_slot_and_metrics(tmp_path):
    for name in ("m-00002-of-00003.gguf", "m-00001-of-00003.gguf", "m-00003-of-00003.gguf", ".complete"):
        (tmp_path / name).write_bytes(b"")
    argv = engines.command("llamacpp", tmp_path, 9000, ["--ctx-size", "4096"], which=on_path)
    assert argv == [
        *[LLAMA_SERVER, "--model", str(tmp_path / "m-00001-of-00003.gguf"), "--host", "127.0.0.1", "--port", "9000"],
        # Chosen by the agent and said: the CPUs it may use, not llama-server's count of cores.
        *["--threads", str(len(os.sched_getaffinity(0)))],
        # Written even when one: left out, llama-server takes 4 slots over one unified pool.
        *["--parallel", "1"],
        # /metrics is where the agent reads the slots from; no web UI on an engine's port; the prompt
        # cache and a slot chosen by its prompt's similarity, what prefix routing sends a conversation back for.
        *["--metrics", "--no-webui", "--cache-prompt", "--slot-prompt-similarity", "0.10"],
        *["--ctx-size", "4096"],
    ]


def test_a_profiles_own_threads_and_slots_win_over_the_agents_choice(tmp_path):
    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"")
    args = ["--threads", "1", "--parallel", "8", "--ctx-size", "8192"]
    argv = engines.command("llamacpp", weights, 9001, args, which=on_path)
    assert argv[7:] == ["--metrics", "--no-webui", "--cache-prompt", "--slot-prompt-similarity", "0.10", *args]


def test_a_profiles_own_slot_similarity_wins_over_the_agents(tmp_path):
    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"")
    argv = engines.command("llamacpp", weights, 9001, ["-sps", "0.5"], which=on_path)
    assert "--slot-prompt-similarity" not in argv and argv[-2:] == ["-sps", "0.5"]


def test_a_node_without_llama_server_is_told_how_to_get_one(tmp_path, monkeypatch):
    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"")
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    with pytest.raises(engines.EngineError, match="llama-server is not installed on this node: run `make engine`"):
        engines.command("llamacpp", weights, 9001, [], which=no_llama_server)


def test_the_setting_names_the_llama_server_a_node_runs_before_path(tmp_path, monkeypatch):
    binary = tmp_path / "llama-server-custom"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    monkeypatch.setenv("LLMGW_LLAMA_SERVER", str(binary))
    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"")
    assert engines.command("llamacpp", weights, 9001, [], which=on_path)[0] == str(binary)


def test_make_engine_links_this_cpus_build_beside_the_interpreter_where_the_agent_finds_it():
    beside = Path(sys.executable).parent / "llama-server"
    assert beside.is_symlink(), "run `make engine`: it links llama-server into the venv"
    built = Path(os.readlink(beside))
    where = subprocess.run(
        ["sh", "scripts/build-engine.sh", "--where"], cwd=BASE_DIR, capture_output=True, text=True, check=True
    ).stdout.strip()
    # Keyed by its flags under the cache: the mix this machine (or LLMGW_ENGINE_ISA) asks for.
    assert str(built) == where and "/llama-server-0.3.36-" in where
    assert (built.parent / "CMAKE_ARGS").read_text().startswith("-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF")


def test_a_set_without_a_gguf_file_is_refused_with_a_sentence(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(engines.EngineError, match="holds no .gguf file for llama.cpp"):
        engines.command("llamacpp", tmp_path, 9000, [], which=on_path)


def test_vllm_is_handed_the_directory(tmp_path):
    argv = engines.command("vllm", tmp_path, 9002, ["--dtype", "half"], which=lambda n: "/opt/bin/vllm")
    assert argv == ["/opt/bin/vllm", "serve", str(tmp_path), "--host", "127.0.0.1", "--port", "9002", "--dtype", "half"]


# vLLM cannot run here (it needs a GPU), so its argument list is the honest check
# that it serves under the catalog's name, the "model" the gateway forwards.


def test_vllm_serves_under_the_catalog_name_so_the_gateway_forwarded_model_is_not_refused(tmp_path):
    argv = engines.command(
        "vllm", tmp_path, 9002, ["--dtype", "half"], model="llama-3", which=lambda n: "/opt/bin/vllm"
    )
    assert argv == [
        *["/opt/bin/vllm", "serve", str(tmp_path), "--host", "127.0.0.1", "--port", "9002"],
        *["--served-model-name", "llama-3", "--dtype", "half"],
    ]


@pytest.mark.parametrize("named", [["--served-model-name", "mine"], ["--served-model-name=mine"]])
def test_a_profile_that_names_the_served_model_itself_is_left_to_do_so(tmp_path, named):
    argv = engines.command("vllm", tmp_path, 9002, named, model="llama-3", which=lambda n: "/opt/bin/vllm")
    assert argv == ["/opt/bin/vllm", "serve", str(tmp_path), "--host", "127.0.0.1", "--port", "9002", *named]


def test_llamacpp_is_given_the_catalog_name_as_its_alias_unless_the_profile_names_one(tmp_path):
    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"")
    native = engines.command("llamacpp", weights, 9001, [], model="llama-3", which=on_path)
    assert native[7:9] == ["--alias", "llama-3"]
    own = engines.command("llamacpp", weights, 9001, ["-a", "mine"], model="llama-3", which=on_path)
    assert own[-2:] == ["-a", "mine"] and "llama-3" not in own


@pytest.mark.parametrize("gone", ["--n_ctx", "--interrupt_requests", "--no-slots", "--no-cache-prompt", "--kv-unified"])
def test_what_llama_server_does_not_take_or_would_lose_the_fleet_its_slots_is_refused(tmp_path, gone):
    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"")
    with pytest.raises(engines.EngineError, match=f"{gone} is not an argument llmgw gives llamacpp"):
        engines.command("llamacpp", weights, 9001, [gone, "1"] if gone.startswith("--n_") else [gone], which=on_path)


def test_vllm_missing_says_so(tmp_path):
    with pytest.raises(engines.EngineError, match="vllm is not installed on this node"):
        engines.command("vllm", tmp_path, 9002, [], which=lambda n: None)


@pytest.mark.parametrize("arg", ["--trust-remote-code", "--trust-remote-code=true"])
def test_trust_remote_code_is_refused_unless_allowed(tmp_path, arg):
    with pytest.raises(engines.EngineError, match="refused unless LLMGW_ALLOW_REMOTE_CODE is set"):
        engines.command("vllm", tmp_path, 9002, [arg], which=lambda n: "vllm")
    argv = engines.command("vllm", tmp_path, 9002, [arg], which=lambda n: "vllm", allow_remote_code=True)
    assert argv[-1] == arg


def test_remote_code_is_refused_before_anything_is_fetched(tmp_path):
    fetched, reports = [], Reports()
    ok = start_on_node(
        1,
        "http://mirror/m/v1/",
        "vllm",
        ["--trust-remote-code"],
        cache=tmp_path,
        fetch=lambda s, c: fetched.append(s),
        report=reports,
    )
    assert not ok and fetched == []
    assert reports.states() == ["failed"]
    assert "LLMGW_ALLOW_REMOTE_CODE" in reports.last()[3]


def test_a_failed_fetch_is_reported_with_its_sentence_and_nothing_is_started(tmp_path):
    class FetchError(Exception):
        pass

    def fetch(source, cache):
        raise FetchError(f"{source} did not answer with a manifest")

    reports = Reports()
    assert not start_on_node(1, "http://mirror/m/v1/", "llamacpp", [], cache=tmp_path, fetch=fetch, report=reports)
    assert reports == [
        (1, "fetching", "", ""),
        (1, "failed", "", "http://mirror/m/v1/ did not answer with a manifest"),
    ]
    assert engine_state.read_state(tmp_path)["replicas"] == {}


def test_the_same_start_delivered_twice_fetches_once_and_brings_a_waiting_restart_forward(tmp_path):
    fetched, reports = [], Reports()

    def fetch(source, cache):
        fetched.append(source)
        return tmp_path / "w"

    args = dict(cache=tmp_path, fetch=fetch, report=reports)
    assert start_on_node(1, "http://mirror/m/v1/", "llamacpp", [], **args)
    with engine_state.locked_state(tmp_path) as state:
        state["replicas"]["1"]["next_start"] = time.time() + 3600
    assert start_on_node(1, "http://mirror/m/v1/", "llamacpp", [], **args)
    assert fetched == ["http://mirror/m/v1/"]
    assert reports.states() == ["fetching"]
    assert engine_state.read_state(tmp_path)["replicas"]["1"]["next_start"] == 0.0
    assert list(engine_state.read_state(tmp_path)["replicas"]) == ["1"]


def test_the_model_name_reaches_the_state_and_a_start_without_one_still_runs(tmp_path):
    fetched, reports = [], Reports()

    def fetch(source, cache):
        fetched.append(source)
        return tmp_path / "w"

    args = dict(cache=tmp_path, fetch=fetch, report=reports)
    assert start_on_node(1, "http://mirror/m/v1/", "vllm", [], model="llama-3", **args)
    assert start_on_node(1, "http://mirror/m/v1/", "vllm", [], model="llama-3", **args)
    assert engine_state.read_state(tmp_path)["replicas"]["1"]["model"] == "llama-3"
    # A start queued by a control plane that sent no name: wanted as before, under vLLM's default name.
    assert start_on_node(2, "http://mirror/m/v1/", "vllm", [], **args)
    assert engine_state.read_state(tmp_path)["replicas"]["2"]["model"] == ""
    assert fetched == ["http://mirror/m/v1/"] * 2


def test_an_engine_recorded_before_names_were_kept_is_not_restarted_by_a_start_without_one(tmp_path):
    engine_state.want(tmp_path, 1, "vllm", "http://mirror/m/v1/", tmp_path / "w", [])
    with engine_state.locked_state(tmp_path) as state:
        del state["replicas"]["1"]["model"]
        state["replicas"]["1"]["pid"] = 12345
    assert engine_state.wanted_as(tmp_path, 1, "vllm", "http://mirror/m/v1/", [])
    assert not engine_state.want(tmp_path, 1, "vllm", "http://mirror/m/v1/", tmp_path / "w", [])
    # Given a name, it is started again under it.
    assert engine_state.want(tmp_path, 1, "vllm", "http://mirror/m/v1/", tmp_path / "w", [], "llama-3")
    assert engine_state.read_state(tmp_path)["replicas"]["1"]["replace"]["model"] == "llama-3"


# --- a real llama.cpp ------------------------------------------------------------


def chat(endpoint: str) -> dict:
    r = requests.post(
        endpoint + "/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 8,
            # Random weights may well pick end-of-text first; the test wants tokens.
            "logit_bias": {str(EOS_TOKEN_ID): -100},
        },
        timeout=60,
    )
    r.raise_for_status()
    return r.json()


@pytest.mark.engine
def test_llamacpp_serves_a_three_file_gguf_comes_back_after_a_kill_and_is_adopted(tmp_path, tiny_gguf, engine_cleanup):
    cache = tmp_path / "cache"
    reports = Reports()
    sup = supervisor.Supervisor(cache, reports)
    assert engine_state.want(cache, 1, "llamacpp", "http://mirror/tiny/v1/", tiny_gguf, ["--ctx-size", "256"], "tiny")

    step_until(sup, lambda: "ready" in reports.states(), 120, "llama.cpp to answer on /health")
    _, _, endpoint, _ = reports.last()
    assert reports.states() == ["starting", "ready"]
    first = engine_state.read_state(cache)["replicas"]["1"]
    assert first["argv"][0].endswith("llama-server") and first["argv"][1] == "--model"
    assert first["argv"][2] == str(tiny_gguf / "tiny-00001-of-00003.gguf")
    assert endpoint == f"http://127.0.0.1:{first['port']}/v1"

    # The engine lists itself under the catalog's name, as the gateway does.
    assert [m["id"] for m in requests.get(endpoint + "/models", timeout=10).json()["data"]] == ["tiny"]
    answer = chat(endpoint)
    # Generated up to the limit: tokens, not an empty answer, and counted as such.
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 8
    assert answer["choices"][0]["message"]["role"] == "assistant"

    # The engine dies: the supervisor says so with its last lines, and brings it back.
    os.killpg(first["pid"], signal.SIGKILL)
    step_until(sup, lambda: reports.states()[-1] == "failed", 20, "the crash to be reported")
    reason = reports.last()[3]
    assert reason.startswith("the engine exited with code -9; starting it again in 1 s. Its last lines:")
    assert "llama" in reason or "srv" in reason or "main" in reason
    step_until(sup, lambda: reports.states()[-1] == "ready", 120, "llama.cpp to come back")
    second = engine_state.read_state(cache)["replicas"]["1"]
    assert second["pid"] != first["pid"]
    assert chat(reports.last()[2])["choices"][0]["finish_reason"] == "length"

    # The agent restarts: a new supervisor adopts the running engine rather than starting another.
    reports.clear()
    adopter = supervisor.Supervisor(cache, reports)
    adopter.adopt()
    step_until(adopter, lambda: "ready" in reports.states(), 20, "the adopted engine to be found ready")
    assert reports.states() == ["ready"]
    assert engine_state.read_state(cache)["replicas"]["1"]["pid"] == second["pid"]

    # Stopped on request: the process group is gone and the replica is reported stopped.
    assert engine_state.unwant(cache, 1)
    adopter.step()
    assert reports.states()[-1] == "stopped"
    assert not engines.group_alive(second["pid"])
    assert engine_state.read_state(cache)["replicas"] == {}


@pytest.mark.engine
@pytest.mark.parametrize(
    "bias",
    [
        pytest.param({EOS_TOKEN_ID: 100}, id="an-end-at-once"),
        # Byte tokens (3 + the byte): 0xE2 opens a three-byte character that never comes whole.
        pytest.param({3 + 0xE2: 100}, id="bytes-that-make-no-character"),
    ],
)
def test_bench_times_the_first_token_of_an_answer_that_shows_no_text(tmp_path, tiny_gguf, engine_cleanup, bias):
    """`manage.py bench_replica` on such answers (a random model's, often) once recorded a TTFT of 0."""
    from fleet.bench import stream_once

    cache = tmp_path / "cache"
    reports = Reports()
    sup = supervisor.Supervisor(cache, reports)
    assert engine_state.want(cache, 1, "llamacpp", "http://mirror/tiny/v1/", tiny_gguf, ["--ctx-size", "256"], "tiny")
    step_until(sup, lambda: "ready" in reports.states(), 120, "llama.cpp to answer on /health")
    endpoint = reports.last()[2]

    result = stream_once(endpoint, "", "tiny", "hello", 2, extra={"logit_bias": {str(t): b for t, b in bias.items()}})
    assert result["whole"], result
    assert result["ttft"] is not None and 0 < result["ttft"] <= result["seconds"], result
    assert result["tokens"] >= 1, result


# --- vLLM, by a stand-in ---------------------------------------------------------


def calls_of(log: Path) -> list[list[str]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


@pytest.mark.engine
def test_vllm_stand_in_is_handed_the_directory_and_the_profile_args(tmp_path, vllm_stand_in, engine_cleanup):
    weights = tmp_path / "weights"
    weights.mkdir()
    cache = tmp_path / "cache"
    reports = Reports()
    sup = supervisor.Supervisor(cache, reports)
    engine_state.want(cache, 1, "vllm", "http://mirror/m/v1/", weights, ["--max-model-len", "2048"], "m")
    step_until(sup, lambda: "ready" in reports.states(), 30, "the vLLM stand-in to answer")
    port = engine_state.read_state(cache)["replicas"]["1"]["port"]
    assert calls_of(vllm_stand_in) == [
        ["serve", str(weights), "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "m"]
        + ["--max-model-len", "2048"]
    ]
    assert reports.last()[2] == f"http://127.0.0.1:{port}/v1"


@pytest.mark.engine
def test_engines_outlive_a_killed_supervisor_process_which_a_new_one_adopts(tmp_path, vllm_stand_in, engine_cleanup):
    """The supervisor as the agent runs it, a real process reporting through the real broker."""
    weights = tmp_path / "weights"
    weights.mkdir()
    cache = tmp_path / "cache"
    broker = redis.Redis.from_url(settings.REDIS_URL)
    broker.delete("control")
    engine_state.want(cache, 5, "vllm", "http://mirror/m/v1/", weights, [])
    # A node's environment, and the stand-in's log (its PATH comes from the machine's, the fixture's).
    env = node_env(LLMGW_NODE_TOKEN="llmgw-node-test", VLLM_STAND_IN_LOG=vllm_stand_in)

    def start_supervisor() -> subprocess.Popen:
        log = open(tmp_path / "supervisor.log", "ab")
        argv = [sys.executable, "-m", "agent.supervisor", "--cache", str(cache)]
        return subprocess.Popen(argv, env=env, cwd=BASE_DIR, stdout=log, stderr=subprocess.STDOUT)

    def reported() -> list[list]:
        """[node, replica, state, endpoint] of each signed report on control (contracts.signing.sign_message)."""
        # Kombu pushes on the left: the oldest message is last.
        bodies = [json.loads(m) for m in reversed(broker.lrange("control", 0, -1))]
        messages = [json.loads(base64.b64decode(b["body"]))[0][0] for b in bodies]
        return [[m["node"], m["body"]["replica"], m["body"]["state"], m["body"]["endpoint"]] for m in messages]

    first = start_supervisor()
    try:
        wait_until(lambda: any(r[2] == "ready" for r in reported()), timeout=60, what="a ready report on control")
    finally:
        first.kill()
        first.wait(timeout=10)
    assert reported()[0][1:3] == [5, "starting"]
    sent = [base64.b64decode(json.loads(m)["body"]) for m in broker.lrange("control", 0, -1)]
    assert not any(b"llmgw-node-test" in body for body in sent), "the node's token crossed the broker"
    pid = engine_state.read_state(cache)["replicas"]["5"]["pid"]
    assert engines.group_alive(pid), "the engine died with its supervisor"

    broker.delete("control")
    second = start_supervisor()
    try:
        wait_until(lambda: any(r[2] == "ready" for r in reported()), timeout=60, what="the adopted engine's report")
        assert engine_state.read_state(cache)["replicas"]["5"]["pid"] == pid
        assert len(calls_of(vllm_stand_in)) == 1, "the engine was started a second time instead of adopted"
        engine_state.unwant(cache, 5)
        wait_until(lambda: any(r[2] == "stopped" for r in reported()), timeout=30, what="the stop to be reported")
        assert not engines.group_alive(pid)
    finally:
        second.send_signal(signal.SIGTERM)
        second.wait(timeout=10)


@pytest.mark.engine
def test_a_replica_wanted_with_other_args_is_stopped_and_started_with_them(tmp_path, vllm_stand_in, engine_cleanup):
    weights = tmp_path / "weights"
    weights.mkdir()
    cache = tmp_path / "cache"
    reports = Reports()
    sup = supervisor.Supervisor(cache, reports)
    engine_state.want(cache, 1, "vllm", "http://mirror/m/v1/", weights, ["--max-model-len", "2048"])
    step_until(sup, lambda: "ready" in reports.states(), 30, "the vLLM stand-in to answer")
    old_pid = engine_state.read_state(cache)["replicas"]["1"]["pid"]

    assert engine_state.want(cache, 1, "vllm", "http://mirror/m/v1/", weights, ["--max-model-len", "4096"])
    step_until(sup, lambda: reports.states().count("ready") == 2, 30, "the engine to be started with the new args")
    assert [call[-1] for call in calls_of(vllm_stand_in)] == ["2048", "4096"]
    assert not engines.group_alive(old_pid)
    assert "stopped" not in reports.states()


def test_an_engine_listening_everywhere_is_advertised_by_the_host_name(tmp_path):
    import socket

    assert supervisor.Supervisor(tmp_path, Reports(), host="0.0.0.0").endpoint(9000) == (
        f"http://{socket.gethostname()}:9000/v1"
    )
    assert supervisor.Supervisor(tmp_path, Reports(), host="10.0.0.5").endpoint(9000) == "http://10.0.0.5:9000/v1"
    assert supervisor.Supervisor(tmp_path, Reports(), host="0.0.0.0", advertise="gpu-2.lan").endpoint(9000) == (
        "http://gpu-2.lan:9000/v1"
    )


@pytest.mark.engine
def test_an_engine_that_hangs_is_killed_and_started_again(tmp_path, vllm_stand_in, engine_cleanup):
    """Alive but serving nobody: SIGSTOP keeps the process but silences it, as a deadlock would."""
    weights = tmp_path / "weights"
    weights.mkdir()
    cache = tmp_path / "cache"
    reports = Reports()
    sup = supervisor.Supervisor(
        cache, reports, liveness_interval=0.5, liveness_timeout=0.5, liveness_failures=2, backoff_max=1
    )
    engine_state.want(cache, 1, "vllm", "http://mirror/m/v1/", weights, [])
    step_until(sup, lambda: "ready" in reports.states(), 30, "the vLLM stand-in to answer")
    hung_pid = engine_state.read_state(cache)["replicas"]["1"]["pid"]
    os.killpg(hung_pid, signal.SIGSTOP)

    step_until(sup, lambda: "failed" in reports.states(), 30, "the hung engine to be noticed")
    assert "stopped answering" in reports.last()[3]
    assert not engines.group_alive(hung_pid)
    step_until(sup, lambda: reports.states().count("ready") == 2, 30, "a new engine to answer")
    assert engine_state.read_state(cache)["replicas"]["1"]["pid"] != hung_pid


def test_agent_stop_engines_stops_what_this_hosts_agent_started_without_a_token_or_a_broker(tmp_path, engine_cleanup):
    """What `make run` calls at its end: engines outlive the agent, but not the whole llmgw on one machine."""
    cache = tmp_path / "cache"
    engine = engines.spawn([sys.executable, "-c", "import time; time.sleep(300)"], cache / "engine.log")
    engine_state.want(cache, 3, "vllm", "http://mirror/m/v1/", tmp_path, [])
    with engine_state.locked_state(cache) as state:
        state["replicas"]["3"].update(pid=engine.pid, pid_started=engines.start_time(engine.pid))
    env = node_env(REDIS_URL="redis://127.0.0.1:9/0")
    env.pop("LLMGW_NODE_TOKEN", None)
    argv = [sys.executable, "manage.py", "agent", "--node", "gpu-1", "--cache", str(cache), "--stop-engines"]
    done = subprocess.run(argv, env=env, cwd=BASE_DIR, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"Stopping the engine of replica 3 (pid {engine.pid}).\n"
    assert engine.wait(timeout=15) == -signal.SIGTERM
