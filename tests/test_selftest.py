"""The agent proves an engine works before it says so: a quantized model, one token, a timeout.

The engine that fails is a real process failing for real: a `llama-server` on the
agent's PATH (tests/fake_llama_server.py) that loads, answers /v1/models, and dies by
SIGILL on its first token, the way llama.cpp built with AMX dies on these CPUs, or
never answers. The engine that works is this host's own llama.cpp.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType, GGUFReader

from agent import selftest
from fleet import reconcile
from fleet.models import Node, Replica
from fleet.placement import ModelView, ProfileView
from serving.planning import FileFacts, NodeFacts, plan_serve

from . import fake_llama_server
from .support.processes import start_agent
from .support.waiting import wait_until

SIGILL_SENTENCE = "llama.cpp crashed with SIGILL on this CPU"


def running(executable) -> bool:
    """Whether a process runs this executable (as its script), from /proc."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(executable).encode() in cmdline.read_bytes().split(b"\0"):
                return True
        except OSError:
            continue
    return False


def test_the_selftest_model_has_the_quantized_matrices_that_reach_the_kernels_a_bad_build_crashes_in(tmp_path):
    model = selftest.selftest_model(tmp_path)
    types = {t.name: t.tensor_type for t in GGUFReader(model).tensors}
    assert types["blk.0.attn_q.weight"] == GGMLQuantizationType.Q4_0
    assert types["blk.1.ffn_down.weight"] == GGMLQuantizationType.Q8_0
    assert model.stat().st_size < 1_000_000
    # Written once, then reused: a second agent start does not write it again.
    written = model.stat().st_mtime_ns
    assert selftest.selftest_model(tmp_path).stat().st_mtime_ns == written
    assert [p.name for p in tmp_path.iterdir()] == [selftest.MODEL_NAME]


@pytest.mark.processes  # the self-test starts an engine (from the app's code, out of the collection hook's sight)
def test_an_engine_that_dies_by_sigill_on_its_first_token_is_unusable_and_says_so(tmp_path):
    fake = fake_llama_server.install(tmp_path / "bin", "sigill")
    reason = selftest.check_llamacpp(tmp_path / "selftest", timeout=30, which=lambda name: str(fake))
    assert reason.startswith(SIGILL_SENTENCE + ": it was built for instructions this CPU cannot run")
    assert "scripts/build-engine.sh" in reason


@pytest.mark.processes  # the self-test starts an engine (from the app's code, out of the collection hook's sight)
def test_an_engine_that_never_answers_is_unusable_after_the_timeout_and_is_not_left_running(tmp_path):
    fake = fake_llama_server.install(tmp_path / "bin", "hang")
    started = time.monotonic()
    reason = selftest.check_llamacpp(tmp_path / "selftest", timeout=4, which=lambda name: str(fake))
    assert reason == "llama.cpp did not generate a token within 4 s in its self-test"
    assert time.monotonic() - started < 20
    assert not running(fake)


@pytest.mark.processes  # the self-test starts an engine (from the app's code, out of the collection hook's sight)
def test_an_unusable_engine_is_tested_again_at_the_next_probe(tmp_path, monkeypatch):
    fake = fake_llama_server.install(tmp_path / "bin", "sigill")
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(selftest, "_proven", {})
    runs = []
    check = selftest.check_llamacpp
    monkeypatch.setattr(selftest, "check_llamacpp", lambda *a, **k: runs.append(1) or check(*a, **k))
    for _ in range(2):
        assert selftest.unusable(["llamacpp"], tmp_path / "selftest", timeout=30)["llamacpp"].startswith(
            SIGILL_SENTENCE
        )
    assert len(runs) == 2


@pytest.mark.engine
def test_this_hosts_llamacpp_generates_from_a_quantized_model_and_is_proven_once_per_build(tmp_path, monkeypatch):
    monkeypatch.setattr(selftest, "_proven", {})
    # The engine the supervisor starts here: the llama-server `make engine` linked into the venv.
    assert selftest.check_llamacpp(tmp_path, which=lambda name: None) is None
    assert selftest.unusable(["llamacpp"], tmp_path) == {}
    # Proven for these files: the next probe does not start the engine again.
    monkeypatch.setattr(selftest, "check_llamacpp", lambda *a, **k: pytest.fail("tested again"))
    assert selftest.unusable(["llamacpp"], tmp_path) == {}


def test_switching_the_build_a_link_points_at_is_a_new_engine_to_prove(tmp_path, monkeypatch):
    # `LLMGW_ENGINE_ISA=avx2 make engine` and `make engine` move one link between two builds.
    for mix in ("avx512", "avx2"):
        (tmp_path / mix).mkdir()
        (tmp_path / mix / "llama-server").write_text(f"#!/bin/sh\n# {mix}\n")
        (tmp_path / mix / "llama-server").chmod(0o755)
    link = tmp_path / "llama-server"
    link.symlink_to(tmp_path / "avx512" / "llama-server")
    monkeypatch.setenv("LLMGW_LLAMA_SERVER", str(link))
    first = selftest.fingerprint("llamacpp")
    link.unlink()
    link.symlink_to(tmp_path / "avx2" / "llama-server")
    assert selftest.fingerprint("llamacpp") != first
    assert str(tmp_path / "avx2" / "llama-server") in str(selftest.fingerprint("llamacpp"))


@pytest.mark.django_db(transaction=True)
def test_a_node_whose_llamacpp_crashes_reports_it_unusable_its_page_says_why_and_placement_passes_it_over(
    enrolled_node, control_worker, agent_cache, tmp_path, admin_client
):
    name, token = enrolled_node
    fake = fake_llama_server.install(tmp_path / "bin", "sigill")
    agent = start_agent(name, token, agent_cache, tmp_path, PATH=f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    try:
        node = wait_until(
            lambda: Node.objects.filter(name=name, last_heartbeat__isnull=False).first(),
            timeout=60,
            what=f"a heartbeat\n{agent.output()[-3000:]}",
        )
        assert "llamacpp" not in node.engines
        assert node.engines_unusable["llamacpp"].startswith(SIGILL_SENTENCE)
        assert "llama.cpp is installed but unusable: llama.cpp crashed with SIGILL" in agent.output()

        listing = admin_client.get("/admin/fleet/node/").content.decode()
        assert SIGILL_SENTENCE in listing
        page = admin_client.get(f"/admin/fleet/node/{node.pk}/change/").content.decode()
        assert "installed but unusable" in page.lower() and SIGILL_SENTENCE in page

        # Not "an old agent that reports nothing": the replica is not placed there, and says why.
        cpu = ProfileView("cpu", "llamacpp", args=("--ctx-size", "512"), min_memory_gb=0)
        reconcile.reconcile(models=[ModelView("tiny", "http://127.0.0.1:8001/tiny/v1/", 1, (cpu,))])
        replica = Replica.objects.get(model_name="tiny")
        assert replica.node is None and replica.state == "pending"
        assert f"{name}: llamacpp is installed but unusable (llama.cpp crashed with SIGILL" in replica.reason
    finally:
        agent.stop()


@pytest.mark.django_db(transaction=True)
def test_an_engine_that_hangs_is_reported_unusable_and_its_re_probes_never_stop_the_heartbeat(
    enrolled_node, control_worker, agent_cache, tmp_path
):
    name, token = enrolled_node
    fake = fake_llama_server.install(tmp_path / "bin", "hang")
    agent = start_agent(
        name,
        token,
        agent_cache,
        tmp_path,
        PATH=f"{fake.parent}{os.pathsep}{os.environ['PATH']}",
        LLMGW_SELFTEST_TIMEOUT_S=3,
        LLMGW_AGENT_REPROBE_S=1,
    )
    try:
        node = wait_until(
            lambda: Node.objects.filter(name=name, last_heartbeat__isnull=False).first(), timeout=60, what="a heartbeat"
        )
        assert node.engines_unusable["llamacpp"] == "llama.cpp did not generate a token within 3 s in its self-test"
        # Tested again at every re-probe, each one hanging for 3 s, while the beats go on every
        # second: in the worker's loop, a re-probe would hold each beat back for 3 s.
        # The node's beat is one Redis key, taken by a collection COLLECT_DELAY_S (1 s) after
        # the first beat that asks for one (contracts/tasks.py): beats arriving between two
        # collections are one, so with a beat a second last_heartbeat moves every 2 s or so.
        # What stays true: it keeps moving, never still for as long as a self-test hangs
        # (a beat held back 3 s would leave it still for 4 s and more).
        beats = set()
        until = time.monotonic() + 9
        while time.monotonic() < until:
            beats.add(Node.objects.get(name=name).last_heartbeat)
            time.sleep(0.2)  # sampling the beats over nine seconds, to count them
        times = sorted(beats)
        assert len(times) >= 4, times
        gaps = [(later - earlier).total_seconds() for earlier, later in zip(times, times[1:], strict=False)]
        assert max(gaps) < 3, gaps
        assert agent.output().count("llama.cpp is installed but unusable") >= 2
    finally:
        agent.stop()
    # Stopped in the middle of a self-test, the agent takes that engine with it.
    wait_until(lambda: not running(fake), timeout=10, what="the self-test engine to be stopped")


def test_the_serve_page_warns_when_the_only_llamacpp_in_the_fleet_fails_its_self_test():
    fleet = [NodeFacts(engines=(), engines_unusable=("llamacpp",), memory_gb=32)]
    plan = plan_serve("m", "v1", [FileFacts("m.gguf", 1000)], "http://mirror:8001/", fleet, None)
    assert plan.warning == (
        "no node reports having llamacpp installed, and .gguf weights need it "
        "(installed on 1 node but failing its self-test: the node's page says why)"
    )
    # A fleet that reports nothing at all is a fleet of older agents, and is not warned.
    assert plan_serve("m", "v1", [FileFacts("m.gguf", 1000)], "http://mirror:8001/", [NodeFacts()], None).warning == ""
