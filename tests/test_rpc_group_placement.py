"""Issue 37, the control side: one replica across several nodes, placed, ordered, failed and placed again.

Placement is a pure function (fleet.placement.place); the orders are read off the tests' Redis,
where Celery puts them for the nodes' queues, and the nodes' reports are signed as an agent signs them.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
import urllib.request
from datetime import timedelta

import pytest
from django.utils import timezone

from catalog.models import Model, Profile
from contracts import groups, tasks
from fleet import ray, reconcile
from fleet.enrolment import issue_token
from fleet.live import LISTENING_KEY
from fleet.models import Node, Replica, ReplicaShare
from fleet.placement import ModelView, NodeView, ProfileView, ReplicaView, place
from fleet.tasks import heartbeat, replica_report
from serving.forms import ServeForm
from serving.planning import FileFacts, NodeFacts, plan_serve

from .services import free_port
from .support import node_messages as node
from .support.waiting import wait_until

SOURCE = "http://127.0.0.1:8001/big/v1/"
BIG = ProfileView("cpu", "llamacpp", min_memory_gb=40, nodes=2)


def three_small_nodes(heads: str = "abc", workers: str = "abc") -> list[NodeView]:
    # Each too small alone for 40 GB; any two together hold it. `heads` have the RPC backend
    # in llama-server (Facts `rpc_head`), `workers` rpc-server and stunnel (Facts `rpc`).
    return [
        NodeView(name, engines=frozenset({"llamacpp"}), memory_gb=memory, rpc=name in workers, rpc_head=name in heads)
        for name, memory in (("a", 30), ("b", 20), ("c", 10))
    ]


def big(profile: ProfileView = BIG) -> list[ModelView]:
    return [ModelView("big", SOURCE, 1, (profile,))]


# --- placement: pure ------------------------------------------------------------------------


def test_three_nodes_each_too_small_serve_one_replica_across_two_split_by_free_memory():
    plan = place(three_small_nodes(), big(), [])
    assert plan.unplaced == []
    [a] = plan.assign
    assert a.node == "a"
    assert [(s.node, s.share, s.memory_gb) for s in a.shares] == [("b", 0.4, 16)]
    assert (a.head_share, a.head_gb) == (0.6, 24)
    # Per node, why: what each leads or holds, and of how much free.
    assert "a leads with 60% of the layers, 24 GB of 30 free" in a.explanation
    assert "b holds 40%, 16 GB of 20 free" in a.explanation


def test_a_node_without_the_rpc_backend_is_never_the_head():
    plan = place(three_small_nodes(heads="bc"), big(), [])
    [a] = plan.assign
    assert a.node == "b"
    assert [s.node for s in a.shares] == ["a"]


def test_a_node_that_can_be_a_worker_but_not_a_head_only_ever_holds_a_share():
    # a has rpc-server and stunnel but a llama-server without --rpc: b leads, a works.
    plan = place(three_small_nodes(heads="bc", workers="a"), big(), [])
    [a] = plan.assign
    assert (a.node, [s.node for s in a.shares]) == ("b", ["a"])


def test_a_node_that_can_lead_but_has_no_rpc_server_is_never_a_worker():
    # b's llama-server has the backend but no rpc-server runs there: a leads, c is its worker,
    # and a (30) with c (10) hold the 40 GB.
    plan = place(three_small_nodes(heads="ab", workers="c"), big(), [])
    [a] = plan.assign
    assert (a.node, [s.node for s in a.shares]) == ("a", ["c"])


def test_no_worker_able_node_leaves_the_group_unplaced_with_what_the_head_holds_alone():
    plan = place(three_small_nodes(heads="abc", workers=""), big(), [])
    assert plan.assign == []
    [unplaced] = plan.unplaced
    assert "the 1 with the most free memory hold 30 GB together, needs 40" in unplaced.reason


def test_a_profile_of_one_node_is_not_spread_and_says_why_with_the_largest_node():
    plan = place(three_small_nodes(), big(ProfileView("cpu", "llamacpp", min_memory_gb=40)), [])
    assert plan.assign == []
    [unplaced] = plan.unplaced
    assert "a: 30 GB free, needs 40" in unplaced.reason


def test_no_group_that_holds_it_is_explained_with_what_the_largest_nodes_hold_together():
    plan = place(three_small_nodes(), big(ProfileView("cpu", "llamacpp", min_memory_gb=60, nodes=2)), [])
    [unplaced] = plan.unplaced
    assert "across up to 2 nodes: the 2 with the most free memory hold 50 GB together, needs 60" in unplaced.reason
    plan = place(three_small_nodes(heads=""), big(), [])
    assert "none of the nodes with room can lead a group (no RPC backend)" in plan.unplaced[0].reason


def test_memory_a_worker_holds_for_a_group_is_used_on_its_node():
    group = ReplicaView(1, "big", "cpu", "a", "ready", memory_gb=24, source=SOURCE, shares=(("b", 16, "ready"),))
    small = ModelView("small", SOURCE + "s", 1, (ProfileView("cpu", "llamacpp", min_memory_gb=5),))
    plan = place(three_small_nodes(), [*big(), small], [group])
    # b has 4 GB left and a 6: only c takes the small model; the group stays as it is.
    assert [(a.model, a.node) for a in plan.assign] == [("small", "c")]
    assert plan.stop == []


def test_a_group_whose_worker_node_is_lost_is_stopped_and_placed_again_with_the_worker_named():
    nodes = three_small_nodes()
    nodes[1] = NodeView("b", ready=False, engines=frozenset({"llamacpp"}), memory_gb=20, rpc=True)
    group = ReplicaView(1, "big", "cpu", "a", "ready", memory_gb=24, source=SOURCE, shares=(("b", 16, "ready"),))
    plan = place(nodes, big(), [group])
    assert plan.stop == [1]
    assert plan.stop_reasons[1] == "worker b was lost: the group is placed again"
    # Stopped at once, not drained: a request in flight waits on the lost worker forever
    # (test_rpc_group_fleet.py's partition found it).
    assert plan.stop_now == {1}
    [a] = plan.assign
    assert a.replica is None and (a.node, [s.node for s in a.shares]) == ("a", ["c"])


# --- orders, reports, reconcile: the database and the broker ----------------------------------

pytestmark_db = pytest.mark.django_db(transaction=True)


def orders(broker, queue: str) -> list[tuple[str, list, dict]]:
    out = []
    while (raw := broker.rpop(queue)) is not None:
        message = json.loads(raw)
        args, kwargs, _ = json.loads(base64.b64decode(message["body"]))
        out.append((message["headers"]["task"], args, kwargs))
    return out


@pytest.fixture
def three_rpc_nodes(db):
    now = timezone.now()
    for name, memory in (("a", 30), ("b", 20), ("c", 10)):
        issue_token(name)
        Node.objects.filter(name=name).update(
            last_heartbeat=now, engines=["llamacpp"], memory_gb=memory, rpc=True, rpc_head=True
        )
    Node.objects.filter(name="b").update(address="10.0.0.2")
    return {n.name: n for n in Node.objects.all()}


@pytestmark_db
def test_workers_are_started_first_and_the_head_gets_each_key_sealed_for_it(three_rpc_nodes, broker):
    reconcile.reconcile(models=big())
    replica = Replica.objects.get()
    share = ReplicaShare.objects.get()
    assert (replica.node.name, share.node.name, share.share) == ("a", "b", 0.4)
    assert "b holds 40%" in replica.reason
    [(task, args, kwargs)] = orders(broker, "node.b")
    assert (task, args) == (groups.START_RPC_WORKER, [replica.pk, share.port])
    assert kwargs["head"] == "a" and kwargs["memory_bytes"] == 16 << 30
    [(task, args, kwargs)] = orders(broker, "node.a")
    assert task == "agent.start_replica"
    group = kwargs["group"]
    assert group["head_share"] == 0.6
    [worker] = group["workers"]
    assert (worker["node"], worker["endpoint"], worker["share"]) == ("b", f"10.0.0.2:{share.port}", 0.4)
    # The key the worker derives for itself, which the head opens with its own token hash ...
    psk = groups.rpc_psk(three_rpc_nodes["b"].token_hash, replica.pk, kwargs["nonce"])
    opened = groups.open_psk(three_rpc_nodes["a"].token_hash, worker["sealed_psk"], replica.pk, kwargs["nonce"], "b")
    assert opened == psk
    # ... never crosses the broker as itself, and opens to nothing under another node's key.
    assert worker["sealed_psk"] != psk
    assert (
        groups.open_psk(three_rpc_nodes["c"].token_hash, worker["sealed_psk"], replica.pk, kwargs["nonce"], "b") != psk
    )


@pytestmark_db
def test_each_worker_port_is_unique_on_its_node(three_rpc_nodes, broker, settings):
    reconcile.reconcile(models=big())
    # The first port of the range on b; a port taken on a node is never given to another share there.
    assert ReplicaShare.objects.get().port == settings.RPC_PORT_RANGE[0]
    ReplicaShare.objects.create(
        replica=Replica.objects.create(model_name="x", profile_name="cpu", node=three_rpc_nodes["c"]),
        node=three_rpc_nodes["c"],
        share=0.5,
        port=settings.RPC_PORT_RANGE[0] + 1,
    )
    assert reconcile.free_port(three_rpc_nodes["c"]) == settings.RPC_PORT_RANGE[0]
    assert reconcile.free_port(three_rpc_nodes["b"]) == settings.RPC_PORT_RANGE[0] + 1


@pytestmark_db
def test_a_worker_failure_fails_the_group_naming_it_and_reconcile_places_a_new_group(three_rpc_nodes, broker):
    reconcile.reconcile(models=big())
    replica = Replica.objects.get()
    orders(broker, "node.a"), orders(broker, "node.b")
    replica_report(node.report("b", replica.pk, "ready"))
    assert ReplicaShare.objects.get().state == "ready"
    replica_report(node.report("a", replica.pk, "ready", "http://127.0.0.1:9000/v1"))
    replica_report(node.report("b", replica.pk, "failed", reason="rpc-server exited with signal 9"))
    replica.refresh_from_db()
    assert replica.state == "failed"
    assert replica.reason == "worker b failed: rpc-server exited with signal 9"

    # As any failed replica, it waits its retry delay: no new group on every pass.
    reconcile.reconcile(models=big())
    assert Replica.objects.get().state == "failed"
    Replica.objects.filter(pk=replica.pk).update(since=timezone.now() - timedelta(seconds=11))
    reconcile.reconcile(models=big())
    replica.refresh_from_db()
    assert replica.state == "stopping" and replica.reason == "worker b failed: the group is placed again"
    # The old group's head and worker are both told to stop.
    assert [t for t, _, _ in orders(broker, "node.b")][:1] == [groups.STOP_RPC_WORKER]
    new = Replica.objects.exclude(pk=replica.pk).get()
    assert new.node.name == "a" and [s.node.name for s in new.shares.all()] == ["b"]
    assert [t for t, _, _ in orders(broker, "node.a")] == ["agent.stop_replica", "agent.start_replica"]


@pytestmark_db
def test_the_heads_own_restarts_after_its_worker_failed_keep_the_group_failed_until_it_is_placed_again(
    three_rpc_nodes, broker
):
    # Found end to end (test_rpc_group_fleet.py): the head's supervisor starts its engine again
    # after its backoff, each start reported `starting` then `failed`, and each report put off
    # the group's retry: no new group was ever placed.
    reconcile.reconcile(models=big())
    replica = Replica.objects.get()
    replica_report(node.report("b", replica.pk, "ready"))
    replica_report(node.report("a", replica.pk, "ready", "http://127.0.0.1:9000/v1"))
    replica_report(node.report("b", replica.pk, "failed", reason="rpc-server exited with signal 9"))
    failed_since = Replica.objects.get().since
    replica_report(node.report("a", replica.pk, "failed", reason="it lost its RPC worker b at 10.0.0.2:50100"))
    replica_report(node.report("a", replica.pk, "starting"))
    replica.refresh_from_db()
    assert (replica.state, replica.since, replica.attempts) == ("failed", failed_since, 1)
    assert replica.reason == "worker b failed: rpc-server exited with signal 9"
    Replica.objects.filter(pk=replica.pk).update(since=timezone.now() - timedelta(seconds=11))
    reconcile.reconcile(models=big())
    assert Replica.objects.get(pk=replica.pk).state == "stopping"
    assert Replica.objects.exclude(pk=replica.pk).count() == 1


@pytestmark_db
def test_a_worker_node_lost_places_the_group_again_on_the_nodes_left(three_rpc_nodes, broker):
    reconcile.reconcile(models=big())
    old = Replica.objects.get()
    Node.objects.filter(name="b").update(last_heartbeat=timezone.now() - timedelta(hours=1))
    # The control plane has been listening all along: b's silence is b's.
    broker.hset(LISTENING_KEY, mapping={"last": time.time(), "since": time.time() - 600})
    reconcile.reconcile(models=big())
    old.refresh_from_db()
    assert old.reason == "worker b was lost: the group is placed again"
    new = Replica.objects.exclude(pk=old.pk).get()
    assert [s.node.name for s in new.shares.all()] == ["c"]


@pytestmark_db
def test_a_stranger_nodes_report_for_the_group_is_refused(three_rpc_nodes, broker):
    reconcile.reconcile(models=big())
    replica = Replica.objects.get()
    replica_report(node.report("c", replica.pk, "failed", reason="forged"))
    replica.refresh_from_db()
    assert replica.state == "pending"
    assert ReplicaShare.objects.get().state == "pending"
    # ... and a stranger's ready is not routed to either.
    replica_report(node.report("c", replica.pk, "ready", "http://127.0.0.1:9000/v1"))
    replica.refresh_from_db()
    assert (replica.state, replica.endpoint) == ("pending", "")


@pytestmark_db
def test_a_profile_of_several_nodes_takes_only_an_engine_that_can_spread(db):
    model = Model.objects.create(name="big", source=SOURCE, context_length=4096)
    assert Profile(model=model, name="cpu", engine="llamacpp", nodes=3).problems() == {}
    assert "at least 1 node" in Profile(model=model, name="cpu", engine="llamacpp", nodes=0).problems()["nodes"]
    sentence = Profile(model=model, name="cpu", engine="other", nodes=2).problems()["nodes"]
    assert sentence == "only llama.cpp and vLLM run one replica across several nodes, not other"


# --- the serve page's offer ---------------------------------------------------------------------


def test_the_serve_form_offers_several_nodes_with_the_estimate_per_node_when_no_node_holds_it():
    fleet = [NodeFacts(engines=("llamacpp",), memory_gb=gb) for gb in (30, 20, 10)]
    plan = plan_serve("big", "v1", [FileFacts("big.gguf", 1)], "http://m/", fleet, None, estimated_gb=40)
    assert (plan.nodes, plan.per_node_gb) == (2, 20)
    assert "one replica across 2 nodes needs about 20 GB on each" in plan.warning
    form = ServeForm.for_plan(plan, "http://m/")
    assert form.initial["nodes"] == "2"
    # A model one node holds is offered on one node.
    small = plan_serve("small", "v1", [FileFacts("s.gguf", 1)], "http://m/", fleet, None, estimated_gb=8)
    assert (small.nodes, ServeForm.for_plan(small, "http://m/").initial["nodes"]) == (1, "1")


@pytestmark_db
def test_the_serve_form_saves_the_node_count_and_refuses_one_that_is_not_a_count(db):
    fields = {
        "name": "big",
        "source": "http://m/big/v1/big.gguf",
        "context_length": "4096",
        "replicas": "1",
        "engine": "llamacpp",
        "min_memory_gb": "40",
    }
    form = ServeForm({**fields, "nodes": "2"}, byte_base="http://m/")
    assert form.is_valid(), form.errors
    assert form.entry_profile.nodes == 2
    form = ServeForm({**fields, "nodes": "0"}, byte_base="http://m/")
    assert not form.is_valid()
    assert form.errors["nodes"] == ["a replica runs on at least 1 node"]
    form = ServeForm({**fields, "nodes": "two"}, byte_base="http://m/")
    assert form.errors["nodes"] == ["the node count must be a whole number"]


# --- vLLM over Ray: the commands, run against stand-ins (no GPU here) ----------------------------

RAY_STAND_IN = """#!{python}
# A STAND-IN for Ray's CLI, which the GPU nodes have and this machine does not: it records its arguments.
import json, os, sys
with open(os.environ["VLLM_STAND_IN_LOG"], "a") as f:
    f.write(json.dumps(["ray", *sys.argv[1:]]) + "\\n")
"""


def test_vllm_across_three_nodes_starts_ray_on_the_head_then_the_workers_then_vllm_with_pipeline_stages():
    steps = ray.vllm_group_commands("a", "10.0.0.1", [("b", "10.0.0.2"), ("c", "10.0.0.3")], "/w", 8000, "big", 2)
    assert [(s.node, s.argv[:3]) for s in steps] == [
        ("a", ("ray", "start", "--head")),
        ("b", ("ray", "start", "--address=10.0.0.1:6379")),
        ("c", ("ray", "start", "--address=10.0.0.1:6379")),
        ("a", ("vllm", "serve", "/w")),
    ]
    serve = steps[-1].argv
    assert serve[serve.index("--pipeline-parallel-size") + 1] == "3"
    assert serve[serve.index("--tensor-parallel-size") + 1] == "2"
    assert serve[serve.index("--distributed-executor-backend") + 1] == "ray"
    tensor = ray.vllm_group_commands("a", "10.0.0.1", [("b", "10.0.0.2")], "/w", 8000, "big", 2, parallel="tensor")
    assert "--pipeline-parallel-size" not in tensor[-1].argv
    assert tensor[-1].argv[tensor[-1].argv.index("--tensor-parallel-size") + 1] == "4"


def test_the_ray_and_vllm_commands_run_in_their_order_against_stand_ins(tmp_path, vllm_stand_in):
    bin_dir = vllm_stand_in.parent / "bin"
    (bin_dir / "ray").write_text(RAY_STAND_IN.format(python=sys.executable))
    (bin_dir / "ray").chmod(0o755)
    port = free_port()
    steps = ray.vllm_group_commands("a", "127.0.0.1", [("b", "127.0.0.1")], str(tmp_path), port, "big")
    for step in steps[:-1]:
        subprocess.run(step.argv, check=True, timeout=30)
    engine = subprocess.Popen(steps[-1].argv)
    try:
        wait_until(
            lambda: _answers(f"http://127.0.0.1:{port}/v1/models"), what="the vLLM stand-in to answer on the head"
        )
    finally:
        engine.kill()
        engine.wait()
    calls = [json.loads(line) for line in vllm_stand_in.read_text().splitlines()]
    assert [c[:3] for c in calls] == [
        ["ray", "start", "--head"],
        ["ray", "start", "--address=127.0.0.1:6379"],
        ["serve", str(tmp_path), "--host"],
    ]
    assert calls[-1][calls[-1].index("--pipeline-parallel-size") + 1] == "2"


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


@pytestmark_db
def test_a_worker_still_running_a_share_of_a_group_that_is_gone_is_told_to_stop_its_rpc_worker(three_rpc_nodes, broker):
    reconcile.reconcile(models=big())
    replica = Replica.objects.get()
    orders(broker, "node.b")
    Replica.objects.all().delete()
    body = {"replica": replica.pk, "state": "ready", "endpoint": "", "reason": "", "role": "worker"}
    replica_report(node.signed("b", tasks.REPLICA_REPORT, body))
    assert [t for t, _, _ in orders(broker, "node.b")] == [groups.STOP_RPC_WORKER]


@pytestmark_db
def test_a_heartbeat_says_whether_the_node_can_lead_a_group_and_an_older_one_says_it_cannot(three_rpc_nodes, broker):
    heartbeat(node.heartbeat("c", {"engines": ["llamacpp"], "memory_gb": 10, "rpc": False}))
    assert Node.objects.get(name="c").rpc is False
    heartbeat(node.heartbeat("c", {"engines": ["llamacpp"], "memory_gb": 10, "rpc": True}))
    assert Node.objects.get(name="c").rpc is True
    # A word where true or false goes is refused, and changes nothing.
    heartbeat(node.heartbeat("c", {"engines": ["llamacpp"], "memory_gb": 10, "rpc": "yes"}))
    assert Node.objects.get(name="c").rpc is True
    # An agent older than the RPC build says nothing: it cannot lead.
    heartbeat(node.heartbeat("c", {"engines": ["llamacpp"], "memory_gb": 10}))
    assert Node.objects.get(name="c").rpc is False


@pytestmark_db
def test_a_heartbeat_says_apart_whether_the_node_can_be_a_worker_and_whether_it_can_lead(three_rpc_nodes, broker):
    heartbeat(node.heartbeat("c", {"engines": ["llamacpp"], "memory_gb": 10, "rpc": True, "rpc_head": False}))
    c = Node.objects.get(name="c")
    assert (c.rpc, c.rpc_head) == (True, False)
    heartbeat(node.heartbeat("c", {"engines": ["llamacpp"], "memory_gb": 10, "rpc": False, "rpc_head": True}))
    c = Node.objects.get(name="c")
    assert (c.rpc, c.rpc_head) == (False, True)
    # A number where true or false goes is refused, and changes nothing.
    heartbeat(node.heartbeat("c", {"engines": ["llamacpp"], "memory_gb": 10, "rpc_head": 1}))
    assert Node.objects.get(name="c").rpc_head is True
