"""Issue 37, item 2: making room, draining and rolling replacement treat a group as one replica.

Pure: placement (fleet.placement.place) and the choice of what to stop (fleet.room) over snapshots,
as tests/test_rpc_group_placement.py places groups; no process is started.
"""

from __future__ import annotations

import time

from fleet import room
from fleet.placement import FAILED, READY, STOPPING, ModelView, NodeView, ProfileView, ReplicaView, Scaling, place

SOURCE = "http://m/big/"  # what replica() gives a replica of "big"
IDLE = Scaling(fewest=0, most=1)
LLAMA = frozenset({"llamacpp"})


def node(name: str, memory_gb: int, **more) -> NodeView:
    return NodeView(name, engines=LLAMA, memory_gb=memory_gb, rpc=True, rpc_head=True, **more)


def idle_model(name: str, last_request: float = 0.0) -> ModelView:
    """A model at one replica that may give it up (its fewest is 0)."""
    return ModelView(name, f"http://m/{name}/", 1, (ProfileView("cpu", "llamacpp"),), scaling=IDLE, last_request=0.0)


def waking(name: str, profile: ProfileView) -> ModelView:
    return ModelView(name, SOURCE, 1, (profile,), scaling=Scaling(), make_room=True, last_request=time.time())


def replica(id: int, model: str, on: str, memory_gb: int, shares=(), state: str = READY, **more) -> ReplicaView:
    return ReplicaView(
        id, model, "cpu", on, state=state, memory_gb=memory_gb, source=f"http://m/{model}/", shares=shares, **more
    )


def reason_of(plan, model: str) -> str:
    return next(u.reason for u in plan.unplaced if u.model == model)


def test_a_groups_share_is_memory_used_on_its_worker_and_stopping_the_group_to_make_room_stops_it_whole():
    # The group "idle" leads on a (24 GB) and holds 16 GB on b; the waking model may only run on b.
    nodes = [node("a", 30), node("b", 20, labels={"zone": "b"})]
    group = replica(1, "idle", "a", 24, shares=(("b", 16, READY),))
    wake = waking("wake", ProfileView("cpu", "llamacpp", min_memory_gb=10, node_selector={"zone": "b"}))
    plan = place(nodes, [idle_model("idle"), wake], [group])
    # b's free 4 GB is what the share leaves: the group is the replica to stop there, and it is stopped whole.
    assert plan.stop == [1]
    assert plan.stop_reasons[1] == (
        "stopped to make room for wake: frees 24 GB on a, 16 GB on b: a group across 2 nodes, stopped whole"
    )
    assert plan.made_room == {"idle": 1}
    assert reason_of(plan, "wake") == "waiting for room on b: stopping idle replicas of idle"


def test_a_group_needing_room_on_two_nodes_has_it_made_on_them_together():
    # Each node is full of another model's idle replica; no node alone holds 40 GB even emptied.
    nodes = [node("a", 30), node("b", 20), node("c", 10)]
    held = [replica(1, "x", "a", 20), replica(2, "y", "b", 15), replica(3, "z", "c", 5)]
    models = [idle_model("x"), idle_model("y"), idle_model("z")]
    big = waking("big", ProfileView("cpu", "llamacpp", min_memory_gb=40, nodes=2))
    plan = place(nodes, [*models, big], held)
    # a and b together (30 + 20) hold it once x and y are gone; z on c is left alone.
    assert sorted(plan.stop) == [1, 2]
    assert plan.stop_reasons[1] == "stopped to make room for big: frees 20 GB on a"
    assert reason_of(plan, "big") == "waiting for room on a, b: stopping idle replicas of x, y"

    # The pass after their engines are gone places the group there.
    plan = place(nodes, [*models[2:], big], held[2:])
    [a] = plan.assign
    assert (a.node, [s.node for s in a.shares]) == ("a", ["b"])


def test_replicas_already_stopping_across_the_nodes_are_waited_for_and_nothing_more_is_stopped():
    nodes = [node("a", 30), node("b", 20), node("c", 10)]
    held = [replica(1, "x", "a", 20, state=STOPPING), replica(2, "y", "b", 15, state=STOPPING), replica(3, "z", "c", 5)]
    models = [idle_model("x"), idle_model("y"), idle_model("z")]
    big = waking("big", ProfileView("cpu", "llamacpp", min_memory_gb=40, nodes=2))
    plan = place(nodes, [*models, big], held)
    assert plan.stop == []
    assert reason_of(plan, "big") == "waiting for room on a, b: replicas there are stopping"


def test_no_replica_is_stopped_for_a_group_when_stopping_every_idle_one_would_not_be_enough():
    nodes = [node("a", 30), node("b", 20), node("c", 10)]
    # y has a request in flight: never stopped. Without its 15 GB on b, no two nodes reach 45 (a and c: 40).
    held = [replica(1, "x", "a", 20), replica(2, "y", "b", 15), replica(3, "z", "c", 5)]
    busy_y = ModelView("y", "http://m/y/", 1, (ProfileView("cpu", "llamacpp"),), scaling=IDLE, busy=frozenset({2}))
    big = waking("big", ProfileView("cpu", "llamacpp", min_memory_gb=45, nodes=2))
    plan = place(nodes, [idle_model("x"), busy_y, idle_model("z"), big], held)
    assert plan.stop == []
    assert "across up to 2 nodes: the 2 with the most free memory hold 15 GB together, needs 45" in reason_of(
        plan, "big"
    )


def test_the_group_choice_stops_one_large_idle_replica_rather_than_two_small_ones():
    now = time.time()
    candidates = [
        room.Candidate(1, "small", "a", 10, 0, 100, now - 3600),
        room.Candidate(2, "small", "b", 10, 0, 100, now - 3600),
        room.Candidate(3, "large", "a", 25, 0, 100, now),
    ]

    def two_largest_hold_30(free: dict[str, tuple[int, int]]) -> bool:
        return sum(sorted((m for m, _ in free.values()), reverse=True)[:2]) >= 30

    choice = room.choose_group(
        candidates, {"small": 2, "large": 1}, {"a": (5, 0), "b": (0, 0)}, {}, two_largest_hold_30
    )
    assert [c.replica for c in choice.stop] == [3]
    assert choice.nodes == ("a",)
    # The group's own replica counts where it holds memory: a share on b frees b too.
    group = room.Candidate(4, "g", "a", 5, 0, 100, now, shares=(("b", 25),))
    choice = room.choose_group([group], {"g": 1}, {"a": (0, 0), "b": (0, 0)}, {}, two_largest_hold_30)
    assert [c.replica for c in choice.stop] == [4] and choice.nodes == ("a", "b")


def test_draining_a_node_that_holds_a_share_replaces_the_group_elsewhere_and_stops_it_once_the_new_one_serves():
    nodes = [node("a", 30), node("b", 20, draining=True), node("c", 30), node("d", 20)]
    profile = ProfileView("cpu", "llamacpp", min_memory_gb=40, nodes=2)
    big = ModelView("big", SOURCE, 1, (profile,))
    old = replica(1, "big", "a", 24, shares=(("b", 16, READY),), engine="llamacpp", args=())
    plan = place(nodes, [big], [old])
    # A new group on nodes that are not draining; the old one serves until then.
    [new] = plan.assign
    assert (new.node, [s.node for s in new.shares]) == ("c", ["d"])
    assert plan.stop == []

    placed = replica(2, "big", new.node, new.memory_gb, tuple((s.node, s.memory_gb, READY) for s in new.shares))
    plan = place(nodes, [big], [old, placed])
    assert (plan.stop, plan.assign) == ([1], [])


def test_a_group_on_nodes_none_of_which_drain_stays_where_it_is():
    nodes = [node("a", 30), node("b", 20), node("c", 20, draining=True)]
    big = ModelView("big", SOURCE, 1, (ProfileView("cpu", "llamacpp", min_memory_gb=40, nodes=2),))
    old = replica(1, "big", "a", 24, shares=(("b", 16, READY),), engine="llamacpp", args=())
    plan = place(nodes, [big], [old])
    assert (plan.stop, plan.assign, plan.unplaced) == ([], [], [])


def test_an_edited_group_on_a_full_fleet_is_stopped_whole_when_only_its_own_room_holds_its_replacement():
    # The old group holds a's 24 GB and b's 16: its replacement fits only in what the old one leaves.
    nodes = [node("a", 30), node("b", 20)]
    big = ModelView("big", SOURCE, 1, (ProfileView("cpu", "llamacpp", min_memory_gb=40, nodes=2),))
    old = replica(1, "big", "a", 24, shares=(("b", 16, READY),), engine="llamacpp", args=("--old-flag",))
    plan = place(nodes, [big], [old])
    assert plan.stop == [1]
    # A failed worker's group is no different: not serving, it is stopped at once.
    failed = replica(1, "big", "a", 24, shares=(("b", 16, FAILED),), engine="llamacpp", args=("--old-flag",))
    assert place(nodes, [big], [failed]).stop == [1]
