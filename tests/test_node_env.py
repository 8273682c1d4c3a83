"""A node started as deploy/ says: deploy/env/node.env's variables, its values filled in, and nothing else.

The agent is started the way deploy/systemd/llmgw-agent.service starts it (its ExecStart,
with this interpreter and a node name for %H), in an environment holding exactly what
node.env sets (plus PATH and HOME, which systemd gives every service): no
DJANGO_SETTINGS_MODULE, no LLMGW_ROLE, no DATABASE_URL. Its token is made the way
docs/fleet.md says, with `manage.py node_token` on the control plane. The node must enrol
and serve a replica of the tiny GGUF.
"""

from __future__ import annotations

import shlex
import subprocess
import sys

import pytest

from agent import engine_state, engines
from fleet.models import Replica

from .services import free_port
from .support.processes import BASE_DIR, Process, ask_replica, env_file, process_env, wait_until
from .support.serving import mirror_tiny, serve_tiny, wait_enrolled

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.engine]

NODE = "n-deployed"


def unit_argv(node: str) -> list[str]:
    """deploy/systemd/llmgw-agent.service's ExecStart, with this interpreter and `node` for %H."""
    unit = (BASE_DIR / "deploy" / "systemd" / "llmgw-agent.service").read_text()
    exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    argv = shlex.split(exec_start.removeprefix("ExecStart="))
    assert argv[0].endswith("/python"), exec_start
    return [sys.executable, *[node if a == "%H" else a for a in argv[1:]]]


@pytest.fixture
def deployed_agent(tmp_path, settings, byte_listener):
    made = subprocess.run(
        [sys.executable, "manage.py", "node_token", NODE],
        cwd=BASE_DIR,
        env=process_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert made.returncode == 0, made.stderr
    cache = tmp_path / "var" / "agent-cache"
    values = {
        "LLMGW_NODE_TOKEN": made.stdout.strip(),
        "REDIS_URL": settings.REDIS_URL,
        # The session's Redis has its default user; tests/test_redis_acl.py runs an agent as node-NAME.
        "LLMGW_REDIS_ACL": "false",
        "LLMGW_BYTES_URL": byte_listener,
        "LLMGW_VAR": str(tmp_path / "var"),
        "LLMGW_AGENT_CACHE": str(cache),
        "LLMGW_ENGINE_HOST": "127.0.0.1",
        "LLMGW_ENGINE_ADVERTISE": "127.0.0.1",
        "LLMGW_PEER_PORT": str(free_port()),
        # Engines as the agent's own user here, whose pytest directories no other user enters;
        # tests/test_engine_fence.py runs them as a user of their own.
        "LLMGW_ENGINE_USER": "",
        "LLMGW_AGENT_METRICS_ADDR": f"127.0.0.1:{free_port()}",
        "LLMGW_AGENT_METRICS_TOKEN": "a-token-for-the-node-scraper",
    }
    names = set(env_file("node"))
    assert names == set(values), f"deploy/env/node.env now sets {sorted(names ^ set(values))}: fill it in here"
    env = {**values, "PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(tmp_path)}
    agent = Process("agent-deployed", unit_argv(NODE), env, tmp_path)
    yield agent, cache
    agent.stop()
    for entry in engine_state.read_state(cache)["replicas"].values():
        if entry.get("pid") and engines.group_alive(entry["pid"]):
            engines.stop_group(entry["pid"], grace=3)


def test_an_agent_with_only_node_env_enrols_and_serves(
    settings, tmp_path, mirror_root, byte_listener, control_worker, deployed_agent, live_server
):
    agent, cache = deployed_agent
    settings.BYTES_URL = byte_listener

    wait_enrolled(agent, NODE, timeout=90)
    mirror_tiny(mirror_root, tmp_path)
    serve_tiny(live_server)
    replica = wait_until(
        lambda: Replica.objects.filter(model_name="tiny", state="ready").first(),
        timeout=240,
        interval=0.5,
        what=f"a ready replica: {list(Replica.objects.values('state', 'reason'))}\n{agent.output()[-3000:]}",
    )
    assert replica.node.name == NODE and replica.endpoint.startswith("http://127.0.0.1:")
    ask_replica(replica)
    assert any(cache.rglob(".complete")), "the weights were fetched into node.env's LLMGW_AGENT_CACHE"
