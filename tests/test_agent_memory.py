"""The agent's measuring: an engine's whole process tree, and nvidia-smi's per-process GPU memory (a mock: no GPU here)."""

from __future__ import annotations

import subprocess
import sys

import psutil
import pytest

from agent import memory

from .support.processes import wait_until

# A launcher whose child holds 80 MB it has written to: the tree's RSS holds both.
CHILD = "x = bytearray(80_000_000); import time; time.sleep(120)"
PARENT = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {CHILD!r}]); time.sleep(120)"


@pytest.fixture
def launcher():
    # In its own session, as agent.engines.spawn starts an engine.
    process = subprocess.Popen([sys.executable, "-c", PARENT], start_new_session=True)
    yield process
    for child in psutil.Process(process.pid).children(recursive=True):
        child.kill()
    process.kill()
    process.wait()


def test_an_engine_s_memory_is_its_whole_process_tree(launcher):
    def child_filled():
        children = psutil.Process(launcher.pid).children()
        return children and children[0].memory_info().rss > 80_000_000

    wait_until(child_filled, timeout=30, what="the child to hold its 80 MB")
    alone = psutil.Process(launcher.pid).memory_info().rss
    tree = memory.process_tree_memory(launcher.pid)
    assert tree["rss"] > alone + 80_000_000
    assert 0 < tree["pss"] <= tree["rss"]
    assert memory.process_tree_memory(2**22 + 12345) is None


def write_mock(path, body: str) -> None:
    path.write_text("#!/bin/sh\n# A MOCK of nvidia-smi for tests/test_agent_memory.py: no GPU runs here.\n" + body)
    path.chmod(0o755)


@pytest.mark.processes  # runs the mock nvidia-smi, a process, through agent/memory.py
def test_gpu_memory_per_process_is_read_from_nvidia_smi_and_nothing_without_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert memory.gpu_memory_by_pid() == {}
    write_mock(tmp_path / "nvidia-smi", 'echo "4242, 1000"\necho "4242, 24"\necho "77, 512"\necho "[N/A], [N/A]"\n')
    # One process on two cards is listed once per card, and the two add up.
    assert memory.gpu_memory_by_pid() == {4242: 1024 << 20, 77: 512 << 20}
    write_mock(tmp_path / "nvidia-smi", "echo 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    assert memory.gpu_memory_by_pid() == {}


def test_a_heartbeat_carries_each_running_engine_s_memory_and_the_node_s_available_memory(tmp_path, launcher):
    from agent import engine_state, engines

    with engine_state.locked_state(tmp_path) as state:
        state["replicas"]["7"] = {"replica": 7, "pid": launcher.pid, "pid_started": engines.start_time(launcher.pid)}
        state["replicas"]["8"] = {"replica": 8, "pid": None}
    facts = memory.heartbeat_facts(tmp_path)
    assert set(facts["replica_memory"]) == {"7"}
    assert facts["replica_memory"]["7"]["rss"] > 0
    assert facts["memory_available_bytes"] > 0
