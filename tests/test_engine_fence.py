"""An engine taken over is not the node: it reads no broker password, no node token, writes no other replica's weights.

An engine runs what its weights make it run (a crafted GGUF that exploits llama-server, a vLLM
model's own code). Here a real agent, and its real supervisor, start an engine that does what
such an engine would: a stand-in `vllm` that looks at its own environment, tries the agent's and
the supervisor's /proc/PID/environ, the node's env file (mode 0600, root's, as deploy/ has it),
and another replica's cached weights, and writes down what it got. And the real llama-server
starts, answers and is stopped as the engine user.

The tests run as root, and root reads every process's environ whether it is dumpable or not
while it holds its capabilities. So the engine runs as a user of its own (LLMGW_ENGINE_USER, made
here if missing), and where the engine runs as the agent's own user, the agent runs with no
capability and the one who tries its environ is a process of the same user with none either:
what an agent (llmgw) and an engine run as its user are on a node.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
import requests

from agent import engine_binary, engine_state, engines
from contracts import credentials, signing
from launcher.demo_model import EOS_TOKEN_ID, write_tiny_llama

from .services import free_port
from .support.processes import BASE_DIR, Process, node_env, start_agent
from .support.waiting import wait_until

ENGINE_USER = "llmgw-engine-test"
TOKEN = "llmgw-node-fence-test-token"
# Whatever else the host gave the agent: not the engine's.
CANARY = "ANOTHER_SERVICES_PASSWORD"
# This user with no capability at all: what a node's agent (llmgw) and its engines are. Root keeps
# its uid, and so still owns what it owns, but reads another process's memory only as its user would.
WITHOUT_CAPABILITIES = ["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--"]

# The engine that was taken over. In the system's Python, which the engine's user can run
# (the venv's interpreter is under root's home); the paths it tries are written in by the test.
PRYING_ENGINE = textwrap.dedent(
    """\
    #!/usr/bin/python3
    import json, os, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer

    if "--version" in sys.argv:  # the agent's probe of what is installed (agent/selftest.py)
        print("0.0.0-prying")
        sys.exit(0)
    supervisor = os.getppid()
    with open(f"/proc/{{supervisor}}/stat") as f:
        agent = int(f.read().rsplit(")", 1)[1].split()[1])
    found = {{"uid": os.getuid(), "groups": os.getgroups(), "environ": dict(os.environ), "cwd": os.getcwd(),
              "supervisor": supervisor, "agent": agent}}

    def attempt(what, action):
        try:
            action()
            found[what] = "done"
        except OSError as error:
            found[what] = "refused: " + (error.strerror or str(error))

    def read(path):
        with open(path, "rb") as f:
            f.read()

    def write(path, mode):
        with open(path, mode) as f:
            f.write(b"taken over")

    attempt("read the supervisor's environ", lambda: read(f"/proc/{{supervisor}}/environ"))
    attempt("read the agent's environ", lambda: read(f"/proc/{{agent}}/environ"))
    attempt("read the node's env file", lambda: read({node_env!r}))
    attempt("rewrite another replica's weights", lambda: write({other!r}, "r+b"))
    attempt("add a file beside another replica's weights", lambda: write({other!r} + ".planted", "xb"))
    attempt("write in its own scratch", lambda: write(os.path.join(os.environ["HOME"], "scratch-file"), "wb"))
    with open(os.path.join({record!r}, "found-%d.json" % os.getpid()), "w") as f:
        json.dump(found, f)

    port = int(sys.argv[sys.argv.index("--port") + 1])
    key = os.environ.get("VLLM_API_KEY")

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            ok = self.headers.get("Authorization") == "Bearer " + str(key)
            body = b'{{"object": "list", "data": [{{"id": "m"}}]}}'
            self.send_response(200 if ok else 401)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    HTTPServer(("127.0.0.1", port), Handler).serve_forever()
    """
)


@pytest.fixture(scope="module")
def engine_user() -> tuple[str, int]:
    """An unprivileged user with a group of its own, for engines: (name, uid)."""
    try:
        pwd.getpwnam(ENGINE_USER)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--user-group", "--no-create-home", "--shell", "/usr/sbin/nologin", ENGINE_USER],
            check=False,  # another test run may have made it meanwhile
            capture_output=True,
        )
    return ENGINE_USER, pwd.getpwnam(ENGINE_USER).pw_uid


@pytest.fixture
def node_files(tmp_path):
    """A node's files where another user may look: pytest's own directory is root's alone (0700).

    `node.env` as deploy/ has it (root's, mode 0600), a cache with another replica's set in it
    (written by the agent's user, as a fetch writes it), the prying engine on PATH as `vllm`,
    and a directory it writes down what it found in.
    """
    root = Path(tempfile.mkdtemp(prefix="llmgw-fence-"))
    root.chmod(0o755)
    cache = root / "cache"
    other = cache / "127.0.0.1_8001" / "other" / "v1" / "model.gguf"
    other.parent.mkdir(parents=True)
    other.write_bytes(b"GGUF another replica's weights")
    env_file = root / "node.env"
    env_file.write_text(f"LLMGW_NODE_TOKEN={TOKEN}\n")
    env_file.chmod(0o600)
    record = root / "found"
    record.mkdir()
    record.chmod(0o1777)
    bin_dir = root / "bin"
    bin_dir.mkdir()
    script = bin_dir / "vllm"
    script.write_text(PRYING_ENGINE.format(node_env=str(env_file), other=str(other), record=str(record)))
    script.chmod(0o755)
    weights = root / "weights"
    weights.mkdir()
    yield {"root": root, "cache": cache, "other": other, "record": record, "bin": bin_dir, "weights": weights}
    for entry in engine_state.read_state(cache)["replicas"].values():
        if entry.get("pid") and engines.group_alive(entry["pid"]):
            engines.stop_group(entry["pid"], grace=3)
    shutil.rmtree(root, ignore_errors=True)


def agent_env(node_files, **extra) -> dict:
    return {
        "PATH": f"{node_files['bin']}{os.pathsep}{os.environ['PATH']}",
        CANARY: "canary-of-another-service",
        **extra,
    }


def secret(replica_id: int, nonce: str) -> str:
    return credentials.replica_secret(signing.token_hash(TOKEN), replica_id, nonce)


def found_by_the_engine(node_files, agent: Process) -> dict:
    def written():
        if not agent.alive():
            raise AssertionError(f"the agent exited:\n{agent.output()}")
        files = list(node_files["record"].glob("found-*.json"))
        return json.loads(files[0].read_text()) if files else None

    return wait_until(written, timeout=60, what=f"the engine to write down what it found\n{agent.output()[-2000:]}")


def ready_entry(cache: Path, replica_id: int, agent: Process) -> dict:
    def ready():
        entry = engine_state.read_state(cache)["replicas"].get(str(replica_id)) or {}
        return entry if entry.get("ready") else None

    log = engine_state.state_dir(cache) / f"replica-{replica_id}.log"
    return wait_until(
        ready,
        timeout=180,
        interval=0.5,
        what=f"replica {replica_id} to answer\n{agent.output()[-2000:]}\n{log.read_text() if log.exists() else ''}",
    )


def stopped(cache: Path, replica_id: int, pid: int, agent: Process) -> None:
    engine_state.unwant(cache, replica_id)
    wait_until(
        lambda: str(replica_id) not in engine_state.read_state(cache)["replicas"] and not engines.group_alive(pid),
        timeout=60,
        what=f"the supervisor to stop replica {replica_id}\n{agent.output()[-2000:]}",
    )


def assert_nothing_of_the_agents(environ: dict, replica_id: int, nonce: str, engine: str) -> None:
    """The engine's environment: ENV_PASSED's and what the supervisor set on purpose, nothing else."""
    assert "REDIS_URL" not in environ and "LLMGW_NODE_TOKEN" not in environ and CANARY not in environ, environ
    from django.conf import settings

    everything = "\0".join(f"{k}={v}" for k, v in environ.items())
    assert TOKEN not in everything and settings.REDIS_URL not in everything
    on_purpose = {"HOME", "TMPDIR", engines.engine_specs.SPECS[engine].secret_variable}
    assert {name for name in environ if not engines.passed(name)} == on_purpose, environ
    assert environ[engines.engine_specs.SPECS[engine].secret_variable] == secret(replica_id, nonce)


@pytest.mark.engine
def test_an_engine_run_as_the_engine_user_reads_no_secret_of_the_node_and_writes_no_other_replicas_weights(
    tmp_path, node_files, engine_user
):
    user, uid = engine_user
    cache = node_files["cache"]
    agent = start_agent("fence", TOKEN, cache, tmp_path, **agent_env(node_files, LLMGW_ENGINE_USER=user))
    try:
        engine_state.want(cache, 7, "vllm", "http://127.0.0.1:8001/m/v1/", node_files["weights"], [], "m", nonce="n7")
        found = found_by_the_engine(node_files, agent)
        assert found["agent"] == agent.popen.pid, "the engine's grandparent is the agent"
        assert found["uid"] == uid and found["groups"] == [], found
        assert_nothing_of_the_agents(found["environ"], 7, "n7", "vllm")

        # Nothing of the node's secrets, nothing of another replica's: refused by the kernel, not just absent.
        for what in (
            "read the supervisor's environ",
            "read the agent's environ",
            "read the node's env file",
            "rewrite another replica's weights",
            "add a file beside another replica's weights",
        ):
            assert found[what].startswith("refused"), (what, found[what])
        assert node_files["other"].read_bytes() == b"GGUF another replica's weights"
        assert not Path(str(node_files["other"]) + ".planted").exists()

        # Its own: a scratch it writes in, which is its home, its temporary directory and where it runs.
        scratch = engine_state.state_dir(cache) / "scratch" / "replica-7"
        assert found["write in its own scratch"] == "done"
        assert found["environ"]["HOME"] == found["environ"]["TMPDIR"] == found["cwd"] == str(scratch)
        assert (scratch / "scratch-file").read_bytes() == b"taken over"
        # Its log is written by the agent and read by nobody else.
        log = engine_state.state_dir(cache) / "replica-7.log"
        assert log.stat().st_uid == os.getuid() and log.stat().st_mode & 0o077 == 0

        # The supervisor's checks reach it with its secret, and stop it, though it is another user's.
        entry = ready_entry(cache, 7, agent)
        assert psutil.Process(entry["pid"]).uids().real == uid
        # Whoever lacks the agent's capabilities cannot, and is told so in a sentence.
        argv = [*WITHOUT_CAPABILITIES, sys.executable, "manage.py", "agent", "--node", "fence", "--stop-engines"]
        refused = subprocess.run(
            [*argv, "--cache", str(cache)], cwd=BASE_DIR, env=node_env(), capture_output=True, text=True, timeout=60
        )
        assert refused.returncode != 0 and "Traceback" not in refused.stderr, refused.stderr
        assert "is another user's (LLMGW_ENGINE_USER): stopping it takes CAP_KILL" in refused.stderr
        assert engines.group_alive(entry["pid"])
        stopped(cache, 7, entry["pid"], agent)
        assert not scratch.exists()
    finally:
        agent.stop()


def read_environ_without_capabilities(pid: int) -> subprocess.CompletedProcess:
    """Read /proc/PID/environ as this user, without capabilities: what an engine of the agent's own user does."""
    read = f"open('/proc/{pid}/environ', 'rb').read(); print('read')"
    return subprocess.run(
        [*WITHOUT_CAPABILITIES, "/usr/bin/python3", "-c", read],
        capture_output=True,
        text=True,
        timeout=30,
    )


@pytest.mark.engine
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) is not installed")
def test_an_engine_run_as_the_agents_own_user_cannot_read_the_agents_or_the_supervisors_environ(tmp_path, node_files):
    cache = node_files["cache"]
    # The agent as a node's agent is: root here, but with no capability, as llmgw has none.
    env = node_env(LLMGW_NODE_TOKEN=TOKEN, LLMGW_HEARTBEAT_S=1, **agent_env(node_files))
    argv = [*WITHOUT_CAPABILITIES, sys.executable, "manage.py", "agent"]
    agent = Process("agent-fence", [*argv, "--node", "fence", "--cache", str(cache)], env, tmp_path)
    try:
        wait_until(lambda: "ready." in agent.output() or not agent.alive(), timeout=60, what="the agent to start")
        assert agent.alive(), agent.output()
        engine_state.want(cache, 8, "vllm", "http://127.0.0.1:8001/m/v1/", node_files["weights"], [], "m", nonce="n8")
        found = found_by_the_engine(node_files, agent)
        assert found["agent"] == agent.popen.pid
        assert_nothing_of_the_agents(found["environ"], 8, "n8", "vllm")
        entry = ready_entry(cache, 8, agent)

        # Of the same user and without capabilities, the engine's own environ is read (it was
        # exec'd: dumpable again), which is how the refusals below are the agent's being not dumpable.
        engine = read_environ_without_capabilities(entry["pid"])
        assert engine.returncode == 0 and "read" in engine.stdout, engine.stderr
        for who, pid in (("the agent", agent.popen.pid), ("the supervisor", found["supervisor"])):
            refused = read_environ_without_capabilities(pid)
            assert refused.returncode != 0 and "PermissionError" in refused.stderr, (who, refused.stdout)
        stopped(cache, 8, entry["pid"], agent)
    finally:
        agent.stop()


def llama_server_for(node_files) -> Path:
    """llama-server where the engine's user can run it: `make engine` keeps it under root's home."""
    built = engine_binary.llama_server()
    if built is None:
        pytest.skip(engine_binary.MISSING)
    built = Path(built).resolve()
    here = node_files["root"] / "llama-server"
    here.mkdir()
    for part in built.parent.iterdir():  # the binary and any library built beside it
        if part.is_file():
            shutil.copy2(part, here / part.name)
    return here / built.name


@pytest.mark.engine
def test_the_real_llama_server_starts_answers_and_is_stopped_as_the_engine_user(tmp_path, node_files, engine_user):
    user, uid = engine_user
    cache = node_files["cache"]
    write_tiny_llama(node_files["weights"])
    server = llama_server_for(node_files)
    agent = start_agent(
        "fence", TOKEN, cache, tmp_path, **agent_env(node_files, LLMGW_ENGINE_USER=user, LLMGW_LLAMA_SERVER=str(server))
    )
    try:
        source = "http://127.0.0.1:8001/tiny/v1/"
        engine_state.want(
            cache, 9, "llamacpp", source, node_files["weights"], ["--ctx-size", "256"], "tiny", nonce="n9"
        )
        entry = ready_entry(cache, 9, agent)
        process = psutil.Process(entry["pid"])
        assert process.uids().real == uid and process.gids().real == pwd.getpwnam(user).pw_gid
        assert grp.getgrgid(process.gids().real).gr_name != "root"
        ask = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        ask["logit_bias"] = {str(EOS_TOKEN_ID): -100}
        chat = f"http://127.0.0.1:{entry['port']}/v1/chat/completions"
        assert requests.post(chat, json=ask, timeout=30).status_code == 401
        answer = requests.post(chat, json=ask, headers=credentials.bearer(secret(9, "n9")), timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] > 0
        stopped(cache, 9, entry["pid"], agent)
    finally:
        agent.stop()


def test_an_engine_user_that_does_not_exist_stops_the_agent_with_a_sentence(tmp_path):
    env = node_env(LLMGW_NODE_TOKEN=TOKEN, LLMGW_ENGINE_USER="no-such-engine-user")
    argv = [sys.executable, "manage.py", "agent", "--node", "fence", "--cache", str(tmp_path / "cache")]
    ran = subprocess.run(argv, env=env, cwd=BASE_DIR, capture_output=True, text=True, timeout=120)
    assert ran.returncode != 0
    assert "LLMGW_ENGINE_USER=no-such-engine-user: there is no such user on this host" in ran.stderr
    assert "Traceback" not in ran.stderr


# --- the agent's /metrics: a slow client holds no thread for long ------------------------------


# The agent's REQUEST_TIMEOUT_S (10 s), with room for a loaded machine.
CUT_OFF_WITHIN_S = 40


def test_the_agents_metrics_cut_off_clients_that_send_nothing_or_trickle_and_a_scrape_still_answers(tmp_path):
    port = free_port()
    agent = start_agent("fence", TOKEN, tmp_path / "cache", tmp_path, LLMGW_AGENT_METRICS_ADDR=f"127.0.0.1:{port}")
    stop = threading.Event()
    try:
        silent = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(40)]
        trickling = socket.create_connection(("127.0.0.1", port), timeout=5)
        trickle_cut = threading.Event()

        def trickle():
            # A byte every half second, never the end of the request line: each read's own timeout never fires.
            try:
                for byte in b"GET /metrics HTTP/1.1 " * 100:
                    if stop.is_set():
                        return
                    trickling.send(bytes([byte]))
                    time.sleep(0.5)  # the trickle itself: what is being tested is a client this slow
            except OSError:
                trickle_cut.set()

        threading.Thread(target=trickle, daemon=True).start()

        # With all of them hanging on, a scrape is answered at once.
        answer = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
        assert answer.status_code == 200 and "llmgw_agent_info" in answer.text

        def closed(connection: socket.socket) -> bool:
            connection.settimeout(0.2)
            try:
                return connection.recv(1) == b""
            except TimeoutError:
                return False
            except ConnectionResetError:
                return True

        wait_until(
            lambda: all(closed(c) for c in silent),
            timeout=CUT_OFF_WITHIN_S,
            what="the agent to close the connections that sent nothing",
        )
        # Cut off by its deadline while it still sends: the whole trickle would take 18 minutes.
        wait_until(
            lambda: trickle_cut.is_set() or closed(trickling),
            timeout=CUT_OFF_WITHIN_S,
            what="the agent to cut off the client that trickles",
        )
        again = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
        assert again.status_code == 200
    finally:
        stop.set()
        agent.stop()


@pytest.mark.engine
def test_an_engine_its_user_cannot_run_is_reported_failed_with_a_sentence_and_not_tried_again(
    tmp_path, engine_user, monkeypatch
):
    from agent import supervisor

    from .support.engines import Reports

    user, _ = engine_user
    # pytest's directory is root's alone (0700): the engine's user cannot reach a `vllm` in it.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "vllm").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "vllm").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    weights = tmp_path / "weights"
    weights.mkdir()
    cache = tmp_path / "cache"
    reports = Reports()
    sup = supervisor.Supervisor(cache, reports, token=TOKEN, engine_user=user)
    engine_state.want(cache, 5, "vllm", "http://mirror/m/v1/", weights, [], "m", nonce="n5")
    sup.step()
    replica, state, _, reason = reports.last(5)
    assert state == "failed", reports
    assert reason.startswith(f"the engine could not be started as {user} (LLMGW_ENGINE_USER): ")
    assert "Permission denied" in reason and "Traceback" not in reason
    sup.step()
    assert reports.states(5) == ["failed"], "tried again"
    assert engine_state.read_state(cache)["replicas"]["5"]["pid"] is None
