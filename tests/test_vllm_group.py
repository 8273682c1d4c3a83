"""Issue 37, item 6: a vLLM replica across two nodes, started by real agents over a Ray cluster of the group.

vLLM and Ray need GPUs, which this machine does not have, so `ray` and `vllm` are stand-ins that
say so (tests/support/ray_stand_in.py): the Ray head listens and counts the workers that joined it,
and vLLM asks it how many nodes it has when it starts. Everything else is real: two agents
(`manage.py agent`, their supervisors and Celery workers), the control plane's Celery worker
placing the group and applying the nodes' reports, Redis as the broker, the byte listener the head
fetches the weights from. Each agent's cache is its own, so a stand-in's working directory says
which node ran it.

The tests run in order on one fleet: the group starts (the head's Ray, the worker joining it, then
`vllm serve` with pipeline stages over both), stops whole, and starts again to have its worker's
Ray killed, which fails the group with a sentence naming the worker.
"""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from celery import current_app

from agent import engine_state, engines, ray_group, supervisor
from catalog.models import Model, Profile
from contracts import tasks
from fleet.enrolment import issue_token
from fleet.live import redis_client
from fleet.models import Node, Replica

from .services import free_port
from .support import ray_stand_in
from .support.database import db_access  # noqa: F401  (a fixture)
from .support.engines import Reports, step_until
from .support.mirror import settle
from .support.processes import Process, start_agent, start_byte_listener, start_celery_worker
from .support.waiting import wait_until
from .weights import write_safetensors

HEAD, WORKER = "vllm-a", "vllm-b"  # equal memory: placement leads with the first by name


def machine_memory_gb() -> int:
    """What each node reports (agent/facts.py): they all share this host's memory."""
    return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30))


class Fleet:
    def __init__(self, log_dir: Path, byte_url: str, ray_port: int):
        self.log_dir, self.byte_url, self.ray_port = log_dir, byte_url, ray_port
        self.events_log = log_dir / "ray-events.jsonl"
        self.caches = {name: log_dir / f"cache-{name}" for name in (HEAD, WORKER)}
        self.agents = {}

    def events(self) -> list[dict]:
        """What the stand-ins did, in order, each with the node whose agent ran it."""
        found = ray_stand_in.events(self.events_log)
        for event in found:
            event["node"] = next((n for n, c in self.caches.items() if event["cwd"].startswith(str(c) + "/")), "?")
        return found

    def said(self) -> str:
        """For a wait's message: the rows, and the end of each agent's log."""
        rows = list(Replica.objects.values_list("pk", "node__name", "state", "reason"))
        shares = [(s.replica_id, s.node.name, s.state, s.reason) for r in Replica.objects.all() for s in r.shares.all()]
        agents = {n: a.output()[-1500:] for n, a in self.agents.items()}
        return f"replicas {rows}; shares {shares}; events {self.events()}; agents {agents}"


def reconcile() -> None:
    """A reconcile pass on the control plane's worker, as its beat sends one."""
    current_app.send_task(tasks.RECONCILE, queue=tasks.CONTROL_QUEUE)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture(scope="module")
def ray_group_fleet(db_access, tmp_path_factory):  # noqa: F811  (the fixture imported above)
    log_dir = tmp_path_factory.mktemp("vllm-group")
    bin_dir = log_dir / "bin"
    ray_stand_in.install(bin_dir)
    mirror = log_dir / "mirror"
    write_safetensors(mirror / "big" / "v1" / "model.safetensors", {"w": ("BF16", [64, 64])})
    settle(mirror)
    redis_client().delete("control", f"node.{HEAD}", f"node.{WORKER}")
    started, starting = [], []
    # Each process started beside the others, and stopped so: one after another they took twice as long.
    pool = ThreadPoolExecutor(4)
    try:
        # The one port of LLMGW_RPC_PORTS is the worker's share's, which is the head's Ray's (fleet/orders.py).
        ray_port = free_port()
        control = pool.submit(
            start_celery_worker,
            "control",
            "control",
            log_dir,
            LLMGW_MIRROR_ROOT=mirror,
            LLMGW_RPC_PORTS=f"{ray_port}-{ray_port}",
        )
        starting.append(control)
        listener, url = start_byte_listener(mirror, log_dir)
        started.append(listener)
        fleet = Fleet(log_dir, url, ray_port)
        stand_ins = {
            "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            "VLLM_STAND_IN_LOG": str(log_dir / "vllm-calls.jsonl"),
            "VLLM_RAY_STAND_IN_LOG": str(fleet.events_log),
        }
        agents = {
            name: pool.submit(start_agent, name, issue_token(name), cache, log_dir, LLMGW_BYTES_URL=url, **stand_ins)
            for name, cache in fleet.caches.items()
        }
        starting += agents.values()
        control.result()
        fleet.agents = {name: agent.result() for name, agent in agents.items()}

        def enrolled():
            nodes = Node.objects.filter(name__in=fleet.caches)
            return len(nodes) == 2 and all(n.state == "ready" and "vllm" in n.engines for n in nodes)

        wait_until(
            enrolled, timeout=120, interval=0.5, what=lambda: f"both agents' heartbeats with vllm: {fleet.said()}"
        )
        yield fleet
    finally:
        started += [future.result() for future in starting if future.exception() is None]
        # The agents are killed: what they would do on the way out is not what these tests look at.
        list(pool.map(lambda process: process.kill() if process.name.startswith("agent-") else process.stop(), started))
        pool.shutdown()
        # What the agents left running (their engines outlive them on purpose): the stand-ins.
        for event in ray_stand_in.events(log_dir / "ray-events.jsonl"):
            if alive(event["pid"]):
                engines.stop_group(event["pid"], grace=3)


def serve_big(fleet: Fleet) -> Replica:
    """The model no one node holds, with a profile that may span two: placed as one group, until ready."""
    model = Model.objects.create(name="big", source=f"{fleet.byte_url}big/v1/model.safetensors", context_length=2048)
    need = machine_memory_gb() * 3 // 2
    Profile.objects.create(
        model=model, name="gpus", engine="vllm", args=["--max-model-len", "2048"], min_memory_gb=need, nodes=2
    )
    reconcile()
    return wait_until(
        lambda: Replica.objects.filter(model_name="big", state="ready").first(),
        timeout=120,
        interval=0.3,
        what=lambda: f"the vLLM group to be ready: {fleet.said()}",
    )


def stop_big(fleet: Fleet) -> None:
    Model.objects.filter(name="big").delete()
    reconcile()
    wait_until(
        lambda: not Replica.objects.exists(), timeout=60, interval=0.3, what=lambda: f"the group gone: {fleet.said()}"
    )


def test_the_head_starts_ray_then_the_worker_joins_it_then_vllm_serves_with_a_pipeline_stage_on_each_node(
    ray_group_fleet,
):
    replica = serve_big(ray_group_fleet)
    [share] = replica.shares.select_related("node")
    assert (replica.node.name, share.node.name) == (HEAD, WORKER)

    head, join, serve = ray_group_fleet.events()
    assert (head["event"], head["node"]) == ("head", HEAD)
    assert head["argv"] == [
        "start",
        "--head",
        f"--port={ray_group_fleet.ray_port}",
        "--node-ip-address=127.0.0.1",
        "--block",
    ]
    assert (join["event"], join["node"]) == ("join", WORKER)
    assert join["argv"] == [
        "start",
        f"--address=127.0.0.1:{ray_group_fleet.ray_port}",
        "--node-ip-address=127.0.0.1",
        "--block",
    ]
    # vllm serve came last, on the head, over the Ray both nodes had joined.
    assert (serve["event"], serve["node"]) == ("serve", HEAD)
    assert serve["ray_address"] == f"127.0.0.1:{ray_group_fleet.ray_port}"
    assert serve["ray_nodes"] == 2
    argv = serve["argv"]
    assert argv[:2] == ["serve", str(Path(argv[1]))] and argv[1].startswith(str(ray_group_fleet.caches[HEAD]))
    for flag, value in (
        ("--pipeline-parallel-size", "2"),
        ("--tensor-parallel-size", "1"),
        ("--distributed-executor-backend", "ray"),
        ("--served-model-name", "big"),
        ("--max-model-len", "2048"),
    ):
        assert argv[argv.index(flag) + 1] == value, argv
    assert replica.endpoint.startswith("http://127.0.0.1:")
    wait_until(
        lambda: replica.shares.get().state == "ready",
        timeout=30,
        what=lambda: f"the worker's share: {ray_group_fleet.said()}",
    )


def test_stopping_the_group_stops_vllm_on_the_head_and_ray_on_each_node(ray_group_fleet):
    pids = {e["event"]: e["pid"] for e in ray_group_fleet.events()}
    assert set(pids) == {"head", "join", "serve"}
    assert all(alive(pid) for pid in pids.values())
    stop_big(ray_group_fleet)
    wait_until(
        lambda: not any(alive(pid) for pid in pids.values()),
        timeout=30,
        what=lambda: f"vllm and each node's ray to stop: {[(e, alive(p)) for e, p in pids.items()]}",
    )


def test_a_workers_ray_failing_fails_the_group_with_a_sentence_naming_the_worker(ray_group_fleet):
    before = len(ray_group_fleet.events())
    serve_big(ray_group_fleet)
    [join] = [e for e in ray_group_fleet.events()[before:] if e["event"] == "join"]
    os.kill(join["pid"], signal.SIGKILL)
    failed = wait_until(
        lambda: Replica.objects.filter(model_name="big", state="failed").first(),
        timeout=60,
        interval=0.3,
        what=lambda: f"the group to fail: {ray_group_fleet.said()}",
    )
    assert failed.reason.startswith(f"worker {WORKER} failed: this worker's ray exited"), failed.reason
    stop_big(ray_group_fleet)


# --- the head alone: its supervisor in this process, the worker played by the test ---------------


@pytest.fixture
def head(tmp_path, monkeypatch, engine_cleanup):
    """A head's supervisor wanting a vLLM group with one worker, `vllm-b`, the stand-ins on PATH."""
    ray_stand_in.install(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("VLLM_STAND_IN_LOG", str(tmp_path / "vllm-calls.jsonl"))
    monkeypatch.setenv("VLLM_RAY_STAND_IN_LOG", str(tmp_path / "ray-events.jsonl"))
    weights = tmp_path / "weights"
    weights.mkdir()
    cache = tmp_path / "cache"
    port = free_port()
    worker = {"node": WORKER, "endpoint": f"127.0.0.1:{port}", "sealed_psk": "", "share": 0.5}
    group = {"head_share": 0.5, "workers": [worker], "ray_port": port}
    engine_state.want(cache, 1, "vllm", "http://m/big/v1/", weights, [], "big", "1", group)
    reports = Reports()
    sup = supervisor.Supervisor(cache, reports, rpc_listen="127.0.0.1")
    yield sup, reports, port, tmp_path
    for event in ray_stand_in.events(tmp_path / "ray-events.jsonl"):
        if alive(event["pid"]):
            engines.stop_group(event["pid"], grace=3)
    sup.ray_head.stop(engine_state.read_state(cache)["replicas"].get("1", {}).get("ray"))


def test_a_head_whose_workers_do_not_join_its_ray_fails_naming_them_and_never_starts_vllm(head, monkeypatch):
    sup, reports, port, tmp_path = head
    events = tmp_path / "ray-events.jsonl"
    step_until(sup, lambda: ray_stand_in.events(events), 60, "the head's Ray to listen")
    # Its Ray up, the head has waited long enough from here on: no worker comes.
    monkeypatch.setattr(ray_group, "JOIN_S", 0.5)
    step_until(sup, lambda: "failed" in reports.states(), 60, "the head to give up on its worker")
    assert reports.states()[0] == "starting"
    assert reports.last()[3].startswith(
        f"1 of the group's 2 nodes joined the head's Ray at 127.0.0.1:{port} within 0.5 s (its workers: {WORKER}); "
        "starting it again in 1 s"
    ), reports.last()
    assert [e["event"] for e in ray_stand_in.events(tmp_path / "ray-events.jsonl")] == ["head"]


def test_the_heads_ray_exiting_under_a_ready_vllm_stops_it_and_fails_the_replica(head):
    sup, reports, port, tmp_path = head
    # The worker node, played here: its `ray start` joining the head's Ray once it listens.
    argv = ["ray", "start", f"--address=127.0.0.1:{port}", "--node-ip-address=127.0.0.1", "--block"]

    def joined():
        sup.step()
        joining = any(w.alive() for w in workers)
        if not joining and not any(e["event"] == "join" for e in ray_stand_in.events(tmp_path / "ray-events.jsonl")):
            workers.append(Process(f"worker-{len(workers)}", argv, dict(os.environ), tmp_path))
        return "ready" in reports.states()

    workers = []
    try:
        wait_until(joined, timeout=60, interval=0.5, what="vllm over the head's Ray, the worker joined")
        events = ray_stand_in.events(tmp_path / "ray-events.jsonl")
        [ray_head] = [e["pid"] for e in events if e["event"] == "head"]
        [vllm] = [e["pid"] for e in events if e["event"] == "serve"]
        os.kill(ray_head, signal.SIGKILL)
        step_until(sup, lambda: reports.states()[-1] == "failed", 30, "the replica to fail with its Ray")
        assert reports.last()[3].startswith("the engine lost the head's ray, which exited; starting it again"), (
            reports.last()
        )
        wait_until(lambda: not alive(vllm), timeout=15, what="vllm to be stopped")
    finally:
        for process in workers:
            process.kill()
