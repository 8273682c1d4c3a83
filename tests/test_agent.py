"""The agent as a node runs it: a real worker process with no database, a real byte listener, a real Redis."""

import hashlib
import os
import signal
import time

import pytest

from agent import progress
from agent.fetch import cache_path
from contracts import keys
from fleet.models import Fetch, Node

from .support.fleet import live, send_fetch
from .support.mirror import put
from .support.processes import CountingProxy, as_node, children_of, start_agent
from .support.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

FILE_BYTES = 1_000_000
NAMES = ["model-00001-of-00004.safetensors", "model-00002-of-00004.safetensors", "config.json", "tokenizer.json"]


def content(name: str, size: int) -> bytes:
    seed = hashlib.sha256(name.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


@pytest.fixture
def four_files(mirror_root):
    files = {name: content(name, FILE_BYTES) for name in NAMES}
    put(mirror_root, "m", "v1", files)
    return files


@pytest.fixture(autouse=True)
def no_tasks_left_from_another_test():
    """Each test's agent starts with nothing queued or unacknowledged for its node.

    The agent takes back what is unacknowledged on its queue at start, so a task
    an earlier test left behind would otherwise run again here.
    """
    client = progress.redis_client()
    client.delete("unacked", "unacked_index", *keys.unacked_keys("n1").values(), "node.n1")


def test_the_agent_heartbeats_with_no_database_reachable(enrolled_node, control_worker, agent_cache, tmp_path):
    name, token = enrolled_node
    agent = start_agent(name, token, agent_cache, tmp_path)
    try:
        node = wait_until(
            lambda: Node.objects.filter(name=name, last_heartbeat__isnull=False).first(),
            timeout=30,
            what="a heartbeat to reach the control plane",
        )
        assert node.labels == {"zone": "test"}
        assert node.disk_free_bytes > 0
        assert node.memory_gb > 0
        assert node.agent_version
        first = node.last_heartbeat
        wait_until(lambda: Node.objects.get(name=name).last_heartbeat > first, timeout=15, what="a second heartbeat")
        assert agent.alive()
        assert "Traceback" not in agent.output()
        # The engine tasks ride on the same worker.
        assert ". agent.start_replica" in agent.output() and ". agent.fetch" in agent.output()
    finally:
        agent.stop()


def test_a_heartbeat_with_a_wrong_token_changes_nothing(enrolled_node, control_worker, agent_cache, tmp_path):
    name, _ = enrolled_node
    agent = start_agent(name, "llmgw-node-not-the-token", agent_cache, tmp_path)
    try:
        refused = f"heartbeat of node {name} refused: its signature does not match"
        wait_until(lambda: refused in control_worker.output(), timeout=30, what="the refusal")
        assert Node.objects.get(name=name).last_heartbeat is None
    finally:
        agent.stop()


def test_a_fetch_sent_to_the_node_queue_is_fetched_whole_and_recorded(
    enrolled_node, control_worker, byte_listener, four_files, agent_cache, tmp_path, redis_client
):
    name, token = enrolled_node
    source = byte_listener + "m/v1/"
    agent = start_agent(name, token, agent_cache, tmp_path, LLMGW_BYTES_URL=byte_listener)
    try:
        send_fetch(name, source)
        fetch = wait_until(
            lambda: Fetch.objects.filter(node__name=name, source=source).first(), timeout=60, what="the report"
        )
        assert fetch.state == "complete", fetch.error
        directory = cache_path(source, agent_cache)
        assert fetch.path == str(directory)
        assert fetch.bytes_total == 4 * FILE_BYTES and fetch.files_total == 4
        for name_, data in four_files.items():
            assert (directory / name_).read_bytes() == data
        snapshot = live(redis_client, source, name)
        assert snapshot["state"] == "complete"
        assert snapshot["bytes_done"] == snapshot["bytes_total"] == 4 * FILE_BYTES
        assert snapshot["files_done"] == snapshot["files_total"] == 4
    finally:
        agent.stop()


def listing(directory) -> dict:
    return {p.name: p.stat().st_size for p in directory.iterdir()}


def part_bytes(directory) -> int:
    return sum(p.stat().st_size for p in directory.glob("*.part")) if directory.exists() else 0


def test_a_worker_killed_halfway_resumes_and_transfers_only_what_was_missing(
    enrolled_node, control_worker, byte_listener, four_files, agent_cache, tmp_path, redis_client
):
    name, token = enrolled_node
    proxy = CountingProxy(byte_listener, rate=400_000)  # per file: about 2.5 s for each
    source = proxy.url + "m/v1/"
    directory = cache_path(source, agent_cache)
    marker = directory / ".complete"
    agent = start_agent(name, token, agent_cache, tmp_path, LLMGW_BYTES_URL=proxy.url, **HTTP_ONLY)
    try:
        send_fetch(name, source)

        def halfway():
            assert not marker.exists(), ".complete appeared before the set was whole"
            snapshot = live(redis_client, source, name)
            return snapshot.get("bytes_done", 0) >= 0.4 * 4 * FILE_BYTES

        wait_until(halfway, timeout=60, interval=0.05, what="the fetch to be halfway")
        agent.kill(signal.SIGKILL)
        assert not marker.exists()
        kept = part_bytes(directory) + sum((directory / n).stat().st_size for n in NAMES if (directory / n).exists())
        assert 0 < kept < 4 * FILE_BYTES

        proxy.reset_counts()
        # Not asked again: the agent takes back the task its killed run left unacknowledged.
        agent = start_agent(name, token, agent_cache, tmp_path, LLMGW_BYTES_URL=proxy.url, **HTTP_ONLY)

        def finished():
            if marker.exists():
                # The marker is only ever beside a whole set: never three files of four.
                assert all((directory / n).stat().st_size == FILE_BYTES for n in NAMES), listing(directory)
            return live(redis_client, source, name).get("state") == "complete"

        wait_until(finished, timeout=90, interval=0.05, what="the resumed fetch to finish")
        assert marker.exists()
        for n, data in four_files.items():
            assert (directory / n).read_bytes() == data
        # What the proxy sent after the restart, less the manifest: exactly the bytes that were missing.
        file_bytes = proxy.body_bytes - _manifest_body_bytes(proxy)
        assert file_bytes == 4 * FILE_BYTES - kept
        assert not list(directory.glob("*.part"))
        assert "Took back 1 task(s)" in agent.output()
    finally:
        agent.stop()
        proxy.stop()


# The HTTP fetcher's own behaviour (parts resumed with Range, bodies cut short, a retry's backoff):
# it stays the fetcher for a mirror that offers no torrent, and these tests keep it to it.
# Through libtorrent the same faults are in tests/test_swarm_fleet.py and tests/test_fetch.py.
HTTP_ONLY = {"LLMGW_FETCH_TORRENT": "false"}


def _manifest_body_bytes(proxy) -> int:
    manifest_gets = [r for r in proxy.requests if r[0] == "GET" and r[1].endswith("/")]
    return len(manifest_gets) * len(as_node.get(proxy.upstream.geturl() + "m/v1/", timeout=5).content)


def test_a_pool_process_killed_mid_fetch_gets_its_task_run_again_without_asking(
    enrolled_node, control_worker, byte_listener, four_files, agent_cache, tmp_path, redis_client
):
    name, token = enrolled_node
    proxy = CountingProxy(byte_listener, rate=400_000)
    source = proxy.url + "m/v1/"
    agent = start_agent(name, token, agent_cache, tmp_path, LLMGW_BYTES_URL=proxy.url)
    try:
        send_fetch(name, source)
        wait_until(
            lambda: live(redis_client, source, name).get("bytes_done", 0) > FILE_BYTES,
            timeout=60,
            what="the fetch to be under way",
        )
        children = children_of(agent.popen.pid)
        assert children
        for pid in children:
            os.kill(pid, signal.SIGKILL)
        # reject_on_worker_lost: the worker puts the task back and a new pool process resumes it.
        fetch = wait_until(
            lambda: Fetch.objects.filter(node__name=name, source=source, state="complete").first(),
            timeout=90,
            what="the task to run again and finish",
        )
        assert (cache_path(source, agent_cache) / ".complete").exists()
        assert "WorkerLostError" in agent.output() or "Process" in agent.output()
        assert fetch.error == ""
    finally:
        agent.stop()
        proxy.stop()


def test_staff_ask_for_a_fetch_and_cancel_it_and_the_node_stops(
    enrolled_node, control_worker, byte_listener, four_files, agent_cache, tmp_path, redis_client
):
    name, token = enrolled_node
    proxy = CountingProxy(byte_listener, rate=200_000)
    source = proxy.url + "m/v1/"
    agent = start_agent(name, token, agent_cache, tmp_path, LLMGW_BYTES_URL=proxy.url, **HTTP_ONLY)
    try:
        fetch = Fetch.objects.request(Node.objects.get(name=name), source)
        wait_until(
            lambda: live(redis_client, source, name).get("bytes_done", 0) > 200_000, timeout=60, what="the fetch"
        )
        assert fetch.cancel()
        wait_until(
            lambda: live(redis_client, source, name).get("state") == "failed", timeout=30, what="the node to stop"
        )
        assert "cancelled by staff" in live(redis_client, source, name)["error"]
        sent = proxy.body_bytes
        time.sleep(1.5)  # proving an absence: no more bytes over the proxy for a while after the cancel
        assert proxy.body_bytes - sent < 100_000  # at most what was in flight
        wait_until(
            lambda: Fetch.objects.get(pk=fetch.pk).finished_at and "cancelled" in Fetch.objects.get(pk=fetch.pk).error,
            timeout=30,
            what="the record to say cancelled",
        )
        assert Fetch.objects.get(pk=fetch.pk).state == "cancelled"
        assert not (cache_path(source, agent_cache) / ".complete").exists()
    finally:
        agent.stop()
        proxy.stop()


def test_the_agent_refuses_to_start_without_a_token_or_a_database(tmp_path):
    import subprocess
    import sys

    from .support.processes import BASE_DIR, node_env

    env = node_env()
    env.pop("LLMGW_NODE_TOKEN", None)
    done = subprocess.run(
        [sys.executable, "manage.py", "agent", "--node", "n9", "--cache", str(tmp_path / "c")],
        cwd=BASE_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert "LLMGW_NODE_TOKEN is not set" in done.stderr
    assert "Traceback" not in done.stderr


def test_an_agent_started_before_its_broker_answers_waits_for_it_and_starts(enrolled_node, agent_cache, tmp_path):
    """A host whose network or broker comes up a moment after the agent (a boot, a link restored).

    Before, the agent's start-up check gave up at the first refused connection ("nothing
    answers at REDIS_URL"), and an agent no service manager started again stayed down:
    tests/test_fleet_netns.py's node restored its link and started its agent, which died of
    "No route to host" while the bridge was being resolved.
    """
    import shutil
    import subprocess
    import sys

    from .services import free_port
    from .support.processes import Process, node_env

    name, token = enrolled_node
    port = free_port()
    env = node_env(LLMGW_NODE_TOKEN=token, LLMGW_HEARTBEAT_S=1, REDIS_URL=f"redis://127.0.0.1:{port}/0")
    argv = [sys.executable, "manage.py", "agent", "--node", name, "--cache", str(agent_cache)]
    agent = Process("agent-early", argv, env, tmp_path)
    broker = None
    try:
        wait_until(
            lambda: "Waiting up to" in agent.output() or not agent.alive(),
            timeout=60,
            what="the agent to say it waits for its broker",
        )
        assert agent.alive(), agent.output()
        broker = subprocess.Popen(
            [shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", ""],
            stdout=subprocess.DEVNULL,
            cwd=tmp_path,
        )
        wait_until(
            lambda: "ready." in agent.output() or not agent.alive(), timeout=60, what="the agent to start on its broker"
        )
        assert agent.alive() and "ready." in agent.output(), agent.output()
        assert "Traceback" not in agent.output()
    finally:
        agent.stop()
        if broker is not None:
            broker.kill()
            broker.wait(timeout=10)


def test_the_same_fetch_sent_twice_at_once_sends_each_byte_once_and_both_finish(
    enrolled_node, control_worker, byte_listener, four_files, agent_cache, tmp_path, redis_client
):
    name, token = enrolled_node
    proxy = CountingProxy(byte_listener, rate=1_000_000)
    source = proxy.url + "m/v1/"
    agent = start_agent(name, token, agent_cache, tmp_path, LLMGW_BYTES_URL=proxy.url, **HTTP_ONLY)
    try:
        send_fetch(name, source)
        send_fetch(name, source)
        wait_until(
            lambda: agent.output().count("Task agent.fetch[") >= 4 and agent.output().count(" succeeded in ") >= 2,
            timeout=60,
            what="both tasks to finish",
        )
        file_gets = [r for r in proxy.requests if r[0] == "GET" and not r[1].endswith("/")]
        assert sorted(r[1].rsplit("/", 1)[1] for r in file_gets) == sorted(NAMES)
        assert proxy.body_bytes - _manifest_body_bytes(proxy) == 4 * FILE_BYTES
        snapshot = live(redis_client, source, name)
        assert snapshot["state"] == "complete" and snapshot["bytes_done"] == 4 * FILE_BYTES
    finally:
        agent.stop()
        proxy.stop()


def test_a_dropped_connection_is_tried_again_with_backoff_and_resumes(
    enrolled_node, control_worker, byte_listener, four_files, agent_cache, tmp_path, redis_client
):
    name, token = enrolled_node
    proxy = CountingProxy(byte_listener)
    proxy.truncate_after = 300_000  # every file body cut short, until the mirror "recovers"
    source = proxy.url + "m/v1/"
    agent = start_agent(name, token, agent_cache, tmp_path, LLMGW_BYTES_URL=proxy.url, **HTTP_ONLY)
    try:
        send_fetch(name, source)
        wait_until(lambda: "trying again in" in agent.output(), timeout=30, what="a retry to be scheduled")
        # The retry's countdown is jittered and can be near 0, so its next attempt may already be
        # fetching when this looks; each attempt cut short queues it again.
        snapshot = wait_until(
            lambda: (s := live(redis_client, source, name)) and s["state"] == "queued" and s,
            timeout=30,
            what="the fetch queued again after a cut",
        )
        assert snapshot["state"] == "queued" and "the part is kept" in snapshot["error"]
        assert not Fetch.objects.filter(source=source).exists()  # not reported as the end: it is not over
        proxy.truncate_after = None
        fetch = wait_until(
            lambda: Fetch.objects.filter(node__name=name, source=source).first(), timeout=60, what="the report"
        )
        assert fetch.state == "complete", fetch.error
        for n, data in four_files.items():
            assert (cache_path(source, agent_cache) / n).read_bytes() == data
        snapshot = live(redis_client, source, name)
        assert snapshot["state"] == "complete" and snapshot["error"] == ""
    finally:
        agent.stop()
        proxy.stop()


def test_a_permanent_failure_is_reported_at_once_with_its_sentence(
    enrolled_node, control_worker, byte_listener, four_files, agent_cache, tmp_path
):
    name, token = enrolled_node
    proxy = CountingProxy(byte_listener)
    proxy.overrides["/m/v1/"] = (200, "text/html", b"<html><a href='x'>x</a></html>")
    source = proxy.url + "m/v1/"
    agent = start_agent(name, token, agent_cache, tmp_path, LLMGW_BYTES_URL=proxy.url)
    try:
        send_fetch(name, source)
        fetch = wait_until(
            lambda: Fetch.objects.filter(node__name=name, source=source).first(), timeout=30, what="the report"
        )
        assert fetch.state == "failed"
        assert fetch.error == (
            f"{source} did not answer with a manifest; a source ending in / has to be a mirror version, "
            "not a directory listing"
        )
        assert "trying again" not in agent.output()
    finally:
        agent.stop()
        proxy.stop()


def test_an_engine_installed_while_the_agent_runs_is_reported_without_a_restart(
    enrolled_node, control_worker, agent_cache, tmp_path
):
    name, token = enrolled_node
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    agent = start_agent(
        name, token, agent_cache, tmp_path, LLMGW_AGENT_REPROBE_S=1, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
    )
    try:
        node = wait_until(
            lambda: Node.objects.filter(name=name, last_heartbeat__isnull=False).first(), timeout=30, what="a heartbeat"
        )
        assert "vllm" not in node.engines
        # Installed by hand on the node: an executable called vllm appears on its PATH.
        (bin_dir / "vllm").write_text("#!/bin/sh\nexit 0\n")
        (bin_dir / "vllm").chmod(0o755)
        wait_until(lambda: "vllm" in Node.objects.get(name=name).engines, timeout=30, what="vllm in the heartbeat")
    finally:
        agent.stop()
