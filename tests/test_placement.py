"""Placement on its own: plain snapshots of a fleet and a catalog, no database."""

from fleet.placement import (
    FAILED,
    READY,
    STOPPING,
    ModelView,
    NodeView,
    ProfileView,
    ReplicaView,
    place,
)

CPU = ProfileView("cpu", "llamacpp", min_memory_gb=8)
GPU = ProfileView("gpu", "vllm", min_memory_gb=16, gpus=1)
SOURCE = "http://mirror:8001/tiny/v1/"


def cpu_node(name: str, memory_gb: int = 32, **kw) -> NodeView:
    return NodeView(name, engines=frozenset({"llamacpp"}), memory_gb=memory_gb, **kw)


def model(replicas: int = 1, *profiles: ProfileView, name: str = "tiny") -> ModelView:
    return ModelView(name, SOURCE, replicas, profiles or (CPU,))


def running(replica_id: int, node: str, profile: ProfileView = CPU, name: str = "tiny", state: str = READY):
    return ReplicaView(replica_id, name, profile.name, node, state, profile.min_memory_gb, profile.gpus, SOURCE)


def nodes_of(plan) -> list[str]:
    return [a.node for a in plan.assign]


def test_a_model_gets_its_replica_on_a_node_that_fits():
    plan = place([cpu_node("cpu-1")], [model()], [])
    assert nodes_of(plan) == ["cpu-1"]
    assert plan.assign[0].replica is None
    assert plan.assign[0].profile == CPU
    assert plan.assign[0].source == SOURCE
    assert plan.unplaced == []


def test_the_example_from_the_issue_says_why_each_node_was_passed_over():
    fleet = [NodeView("gpu-2", engines=frozenset({"vllm"}), memory_gb=64, gpus=2), cpu_node("cpu-1", memory_gb=7)]
    plan = place(fleet, [model()], [])
    assert plan.assign == []
    assert plan.unplaced[0].reason == "cpu-1: 7 GB free, needs 8; gpu-2: no llamacpp"


def test_memory_held_by_replicas_already_on_a_node_is_not_free():
    plan = place([cpu_node("cpu-1", memory_gb=20)], [model(1, name="big"), model()], [running(1, "cpu-1", name="big")])
    assert plan.unplaced == []
    # 20 GB, 8 held: the second model's 8 fit, a third would not.
    plan = place(
        [cpu_node("cpu-1", memory_gb=20)],
        [model(1, name="a"), model(1, name="b"), model()],
        [running(1, "cpu-1", name="a"), running(2, "cpu-1", name="b")],
    )
    assert plan.unplaced[0].reason == "cpu-1: 4 GB free, needs 8"


def test_a_node_that_is_not_ready_or_draining_is_passed_over():
    fleet = [cpu_node("a", ready=False), cpu_node("b", draining=True)]
    plan = place(fleet, [model()], [])
    assert plan.unplaced[0].reason == "a: not ready; b: draining"


def test_a_node_selector_must_match_the_labels():
    profile = ProfileView("cpu", "llamacpp", node_selector={"size": "large"})
    fleet = [cpu_node("a"), cpu_node("b", labels={"size": "small"}), cpu_node("c", labels={"size": "large"})]
    plan = place(fleet, [model(1, profile)], [])
    assert nodes_of(plan) == ["c"]
    plan = place(fleet[:2], [model(1, profile)], [])
    assert plan.unplaced[0].reason == "a: no label size; b: size is small, needs large"


def test_a_gpu_profile_needs_free_gpus():
    gpu_node = NodeView("g", engines=frozenset({"vllm"}), memory_gb=128, gpus=1)
    plan = place([gpu_node], [model(1, GPU)], [running(1, "g", GPU, name="other")])
    assert plan.unplaced[0].reason == "g: 0 GPUs free, needs 1"
    plan = place([gpu_node], [model(1, GPU)], [])
    assert nodes_of(plan) == ["g"]


def test_replicas_of_one_model_are_spread_over_nodes():
    fleet = [cpu_node("a", memory_gb=64), cpu_node("b", memory_gb=32), cpu_node("c", memory_gb=32)]
    plan = place(fleet, [model(3)], [])
    assert sorted(nodes_of(plan)) == ["a", "b", "c"]


def test_spreading_does_not_leave_a_replica_pending_when_one_node_has_room_for_two():
    plan = place([cpu_node("a", memory_gb=64)], [model(2)], [])
    assert nodes_of(plan) == ["a", "a"]


def test_a_node_that_holds_the_weights_is_preferred():
    fleet = [cpu_node("a", memory_gb=64), cpu_node("b", memory_gb=16, holds=frozenset({SOURCE}))]
    assert nodes_of(place(fleet, [model()], [])) == ["b"]


def test_without_weights_anywhere_the_node_with_most_room_is_chosen():
    fleet = [cpu_node("a", memory_gb=16), cpu_node("b", memory_gb=64)]
    assert nodes_of(place(fleet, [model()], [])) == ["b"]


def test_profiles_are_tried_by_priority_before_weight():
    gpu = ProfileView("gpu", "vllm", priority=200, gpus=1)
    fleet = [cpu_node("c"), NodeView("g", engines=frozenset({"vllm"}), memory_gb=64, gpus=1)]
    plan = place(fleet, [model(2, CPU, gpu)], [])
    # The GPU profile first; the second replica finds no GPU left and falls back to the CPU.
    assert [(a.profile.name, a.node) for a in plan.assign] == [("gpu", "g"), ("cpu", "c")]


def test_profiles_of_equal_priority_share_replicas_by_weight():
    heavy = ProfileView("heavy", "llamacpp", weight=3)
    light = ProfileView("light", "llamacpp", weight=1)
    fleet = [cpu_node(f"n{i}") for i in range(8)]
    plan = place(fleet, [model(8, light, heavy)], [])
    names = [a.profile.name for a in plan.assign]
    assert names.count("heavy") == 6 and names.count("light") == 2


def test_a_model_at_its_count_is_left_alone():
    plan = place([cpu_node("a")], [model()], [running(1, "a")])
    assert plan.assign == [] and plan.stop == [] and plan.unplaced == []


def test_scaling_down_stops_the_extras_newest_first():
    fleet = [cpu_node("a"), cpu_node("b"), cpu_node("c")]
    plan = place(fleet, [model(1)], [running(1, "a"), running(2, "b"), running(3, "c")])
    assert sorted(plan.stop) == [2, 3]


def test_scaling_down_drops_a_failed_replica_before_a_ready_one():
    plan = place([cpu_node("a"), cpu_node("b")], [model(1)], [running(1, "a", state=FAILED), running(2, "b")])
    assert plan.stop == [1]


def test_deleting_a_model_stops_its_replicas():
    plan = place([cpu_node("a")], [], [running(1, "a"), ReplicaView(2, "tiny", "cpu", None)])
    assert plan.stop == [1]
    assert plan.forget == [2]


def test_a_removed_profile_is_replaced_by_a_current_one_which_then_takes_over():
    other = ProfileView("other", "llamacpp")
    plan = place([cpu_node("a")], [model(1, other)], [running(1, "a")])
    assert plan.stop == []
    assert [(a.replica, a.profile.name) for a in plan.assign] == [(None, "other")]
    taken_over = place([cpu_node("a")], [model(1, other)], [running(1, "a"), running(2, "a", other)])
    assert taken_over.stop == [1] and taken_over.assign == []


def test_a_stopping_replica_does_not_count_but_still_holds_its_memory():
    plan = place([cpu_node("a", memory_gb=10)], [model()], [running(1, "a", state=STOPPING)])
    assert plan.assign == []
    assert plan.unplaced[0].reason == "a: 2 GB free, needs 8"


def test_a_replica_on_a_node_that_stopped_heartbeating_is_placed_elsewhere():
    fleet = [cpu_node("a", ready=False), cpu_node("b")]
    plan = place(fleet, [model()], [running(7, "a")])
    assert [(a.replica, a.node) for a in plan.assign] == [(7, "b")]
    assert plan.stop == []


def test_a_replica_that_cannot_be_rescheduled_stays_and_says_why():
    plan = place([cpu_node("a", ready=False)], [model()], [running(7, "a")])
    assert plan.unplaced[0].replica == 7
    assert plan.unplaced[0].reason == "a: not ready"


def test_a_pending_replica_keeps_its_row_when_placed():
    plan = place([cpu_node("a")], [model()], [ReplicaView(4, "tiny", "cpu", None)])
    assert [(a.replica, a.node) for a in plan.assign] == [(4, "a")]


def test_with_several_profiles_the_reason_is_given_per_profile():
    plan = place([cpu_node("a", memory_gb=1)], [model(1, CPU, GPU)], [])
    assert plan.unplaced[0].reason == "profile cpu: a: 1 GB free, needs 8. profile gpu: a: no vllm"


def test_a_large_fleet_is_summarised_not_listed():
    fleet = [NodeView(f"n{i:04}", engines=frozenset({"vllm"})) for i in range(1000)]
    reason = place(fleet, [model()], []).unplaced[0].reason
    assert reason == "n0000, n0001, n0002 and 997 more: no llamacpp"


def test_no_nodes_at_all_says_so():
    assert place([], [model()], []).unplaced[0].reason == "no node has enrolled"


def test_a_model_without_profiles_says_so():
    assert place([cpu_node("a")], [ModelView("tiny", SOURCE, 1, ())], []).unplaced[0].reason == (
        "tiny has no profile to run it with"
    )


def test_a_stopping_replica_is_not_stopped_twice_and_is_forgotten_when_its_node_is_lost():
    plan = place(
        [cpu_node("a"), cpu_node("b", ready=False)],
        [],
        [running(1, "a", state=STOPPING), running(2, "b", state=STOPPING)],
    )
    assert plan.stop == []
    assert plan.forget == [2]


def test_when_no_node_reports_any_engine_every_node_is_a_candidate():
    # Agents older than the engine probe: nothing is known, as the serve page assumes too.
    unknown = [NodeView("old-1", memory_gb=4), NodeView("old-2", memory_gb=32)]
    assert nodes_of(place(unknown, [model()], [])) == ["old-2"]
    assert place(unknown[:1], [model()], []).unplaced[0].reason == "old-1: 4 GB free, needs 8"


def test_once_any_node_reports_engines_a_node_reporting_none_is_passed_over():
    fleet = [NodeView("old", memory_gb=32), NodeView("gpu", engines=frozenset({"vllm"}), memory_gb=32)]
    assert place(fleet, [model()], []).unplaced[0].reason == "gpu, old: no llamacpp"


def test_an_edited_profile_replaces_its_replica_and_stops_the_old_one_once_the_new_one_serves():
    old = ReplicaView(1, "tiny", "cpu", "cpu-1", READY, 8, 0, SOURCE, engine="llamacpp", args=("--ctx-size", "512"))
    edited = ProfileView("cpu", "llamacpp", args=("--ctx-size", "4096"), min_memory_gb=8)
    first = place([cpu_node("cpu-1", 64)], [model(1, edited)], [old])
    assert [(a.replica, a.profile.args) for a in first.assign] == [(None, ("--ctx-size", "4096"))]
    assert first.stop == []  # still the only one serving

    starting = ReplicaView(2, "tiny", "cpu", "cpu-1", "starting", 8, 0, SOURCE, engine="llamacpp", args=edited.args)
    assert place([cpu_node("cpu-1", 64)], [model(1, edited)], [old, starting]).stop == []

    ready = ReplicaView(2, "tiny", "cpu", "cpu-1", READY, 8, 0, SOURCE, engine="llamacpp", args=edited.args)
    then = place([cpu_node("cpu-1", 64)], [model(1, edited)], [old, ready])
    assert then.stop == [1] and then.assign == []


def test_a_new_source_replaces_the_replica_of_the_old_version_the_same_way():
    old_source = "http://mirror:8001/tiny/v0/"
    old = ReplicaView(1, "tiny", "cpu", "cpu-1", READY, 8, 0, old_source, engine="llamacpp", args=())
    plan = place([cpu_node("cpu-1", 64)], [model()], [old])
    assert [a.source for a in plan.assign] == [SOURCE] and plan.stop == []
    ready = ReplicaView(2, "tiny", "cpu", "cpu-1", READY, 8, 0, SOURCE, engine="llamacpp", args=())
    assert place([cpu_node("cpu-1", 64)], [model()], [old, ready]).stop == [1]


def test_on_a_full_node_the_old_replica_is_stopped_to_make_room_for_its_replacement():
    old = ReplicaView(1, "tiny", "cpu", "cpu-1", READY, 8, 0, SOURCE, engine="llamacpp", args=("--ctx-size", "512"))
    edited = ProfileView("cpu", "llamacpp", args=("--ctx-size", "4096"), min_memory_gb=8)
    plan = place([cpu_node("cpu-1", 12)], [model(1, edited)], [old])
    assert plan.assign == []
    assert plan.stop == [1]
    assert "cpu-1: 4 GB free, needs 8" in plan.unplaced[0].reason


def test_when_the_replacement_fits_nowhere_for_another_reason_the_old_one_keeps_serving():
    old = ReplicaView(1, "tiny", "cpu", "cpu-1", READY, 8, 0, SOURCE, engine="llamacpp", args=())
    plan = place([cpu_node("cpu-1", 64)], [model(1, GPU)], [old])
    assert plan.stop == []
    assert plan.unplaced and "no vllm" in plan.unplaced[0].reason


def test_a_replica_that_runs_what_the_catalog_says_is_left_alone():
    same = ReplicaView(1, "tiny", "cpu", "cpu-1", READY, 8, 0, SOURCE, engine="llamacpp", args=())
    plan = place([cpu_node("cpu-1", 64)], [model()], [same])
    assert plan.stop == [] and plan.assign == []


def test_a_replica_on_a_draining_node_is_replaced_elsewhere_and_stopped_once_the_new_one_serves():
    """docs/fleet.md, "Removing a node": drain it, and wait until it holds no replica."""
    fleet = [cpu_node("a", draining=True), cpu_node("b")]
    old = ReplicaView(1, "tiny", "cpu", "a", READY, 8, 0, SOURCE, engine="llamacpp", args=())
    plan = place(fleet, [model()], [old])
    assert nodes_of(plan) == ["b"] and plan.stop == [], "the old one serves until the new one does"

    new = ReplicaView(2, "tiny", "cpu", "b", READY, 8, 0, SOURCE, engine="llamacpp", args=())
    plan = place(fleet, [model()], [old, new])
    assert (plan.stop, plan.assign) == ([1], [])


def test_a_replica_on_a_draining_node_keeps_serving_while_no_other_node_can_take_it():
    fleet = [cpu_node("a", draining=True), cpu_node("b", memory_gb=4)]
    old = ReplicaView(1, "tiny", "cpu", "a", READY, 8, 0, SOURCE, engine="llamacpp", args=())
    plan = place(fleet, [model()], [old])
    assert (plan.stop, plan.assign) == ([], [])
