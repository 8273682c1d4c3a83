"""The autoscaler's rules against the real database and Redis, with replicas marked ready by hand.

The same rules run end to end, on the real agent and engine, in test_on_demand.py; here
each is checked in a pass or two, and the pure choices (`decide`, `room.choose`) at the edges.
"""

import time

import pytest

from contracts import demand
from fleet import autoscale, reconcile, room
from fleet.live import redis_client
from fleet.models import Replica, Scale
from fleet.placement import Scaling

from .support.factories import add_node as node
from .support.factories import add_served_model as serve

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_redis")]

SOURCE = "http://127.0.0.1:8001/tiny/v1/"


def load(models: dict | None = None, replicas: dict | None = None, at: float | None = None, field: str = "g1"):
    snapshot = {
        "at": time.time() if at is None else at,
        "models": {m: {"in_flight": f, "waiting": w, "last_request": t} for m, (f, w, t) in (models or {}).items()},
        "replicas": {str(r): n for r, n in (replicas or {}).items()},
    }
    redis_client().hset(demand.LOAD_KEY, field, demand.encode(snapshot))


def all_ready() -> None:
    for replica in Replica.objects.exclude(state="stopping").filter(node__isnull=False):
        replica.enter("ready", endpoint=f"http://127.0.0.1:1/{replica.pk}/v1")
        replica.save()


def test_snapshots_of_two_gateway_processes_are_summed_and_a_stale_one_is_ignored():
    node("a")
    serve("m", scaling_min=1, scaling_max=5, target_load=2)
    reconcile.reconcile()
    all_ready()
    now = time.time()
    load({"m": (3, 0, now)}, field="g1")
    load({"m": (2, 0, now)}, field="g2")
    load({"m": (40, 0, now)}, at=now - 60, field="g3")
    reconcile.reconcile()
    # 3 + 2 in flight at two per replica: three replicas, not twenty.
    assert Scale.objects.get(model_name="m").replicas == 3
    assert Replica.objects.filter(model_name="m").count() == 3


def test_a_wake_for_a_model_whose_most_is_zero_does_nothing_and_an_unknown_model_is_ignored():
    node("a")
    serve("off", scaling_min=0, scaling_max=0)
    from fleet.tasks import wake

    wake("off")
    wake("no-such-model")
    assert not Replica.objects.exists()


def test_making_room_never_stops_a_model_with_a_request_in_flight():
    node("a", memory_gb=10)
    serve("a", memory_gb=10, scaling_min=0, scaling_max=1)
    serve("b", memory_gb=10, scaling_min=0, scaling_max=1)
    autoscale.wake("a", most=1, fewest=0)
    reconcile.reconcile()
    all_ready()
    (a,) = Replica.objects.filter(model_name="a")
    load({"a": (1, 0, time.time()), "b": (0, 1, time.time())}, {a.pk: 1})
    autoscale.wake("b", most=1, fewest=0)
    reconcile.reconcile()
    a.refresh_from_db()
    assert a.state == "ready"
    b = Replica.objects.get(model_name="b")
    assert (b.node, b.reason) == (None, "a: 0 GB free, needs 10")

    load({"a": (0, 0, time.time()), "b": (0, 1, time.time())})
    reconcile.reconcile()
    a.refresh_from_db()
    assert (a.state, a.reason) == ("stopping", "stopped to make room for b: frees 10 GB on a")


def test_making_room_takes_lower_priority_first_then_the_one_idle_longest():
    fits = lambda node, memory, gpus: memory >= 10  # noqa: E731
    now = time.time()
    candidates = [
        room.Candidate(1, "important", "n1", 10, 0, priority=200, last_request=now - 3600),
        room.Candidate(2, "recent", "n2", 10, 0, priority=100, last_request=now - 10),
        room.Candidate(3, "old", "n3", 10, 0, priority=100, last_request=now - 600),
    ]
    free = {"n1": (0, 0), "n2": (0, 0), "n3": (0, 0)}
    spare = {"important": 1, "recent": 1, "old": 1}
    choice = room.choose(candidates, spare, free, {}, fits)
    # Each frees enough alone; the lower priority and longest idle goes: "old" on n3.
    assert [c.replica for c in choice.stop] == [3]
    # A model at its fewest has nothing to spare.
    assert room.choose(candidates[1:], {"recent": 0, "old": 0}, free, {}, fits) is None
    # Replicas already stopping free enough: nothing more is stopped.
    assert room.choose(candidates, spare, free, {"n2": (10, 0)}, fits) == room.Choice("n2", ())


def test_a_model_of_higher_priority_is_never_stopped_to_make_room_for_a_lower_one():
    node("a", memory_gb=10)
    serve("vip", memory_gb=10, scaling_min=0, scaling_max=1, priority=200)
    serve("low", memory_gb=10, scaling_min=0, scaling_max=1, priority=100)
    autoscale.wake("vip", most=1, fewest=0)
    reconcile.reconcile()
    all_ready()
    autoscale.wake("low", most=1, fewest=0)
    reconcile.reconcile()
    assert Replica.objects.get(model_name="vip").state == "ready"
    assert Replica.objects.get(model_name="low").node is None


def test_decide_scales_up_at_once_down_after_quiet_one_at_a_time_and_to_zero_after_idle():
    scaling = Scaling(fewest=0, most=4, target_load=1, quiet_s=60, idle_s=900)
    start = autoscale.State(replicas=1, changed=0.0)
    up, _ = autoscale.decide(scaling, start, {"in_flight": 7, "waiting": 0, "last_request": 1000.0}, 1, 1000.0)
    assert (up.replicas, up.why) == (4, "load: 7 in flight, 0 waiting")
    # Quiet for less than the quiet period: still four.
    calm = {"in_flight": 0, "waiting": 0, "last_request": 1000.0}
    same, _ = autoscale.decide(scaling, up, calm, 4, 1059.0)
    assert same.replicas == 4
    down, reason = autoscale.decide(scaling, same, calm, 4, 1061.0)
    assert (down.replicas, reason) == (3, "quiet 1 min")
    # The next only after another quiet period.
    assert autoscale.decide(scaling, down, calm, 3, 1100.0)[0].replicas == 3
    # Never to zero by quiet; to zero only after the idle time without a request.
    one = autoscale.State(replicas=1, changed=1000.0, last_request=1000.0)
    assert autoscale.decide(scaling, one, calm, 1, 1899.0)[0].replicas == 1
    zero, reason = autoscale.decide(scaling, one, calm, 1, 1900.0)
    assert (zero.replicas, reason) == (0, "idle 15 min")
    # A request waiting for a model at zero wakes it.
    woken, _ = autoscale.decide(scaling, zero, {"in_flight": 0, "waiting": 1, "last_request": 2000.0}, 0, 2000.0)
    assert (woken.replicas, woken.why) == (1, "woken by a request")


def test_a_replica_that_fits_nowhere_keeps_its_row_its_id_and_since_across_passes():
    node("a", memory_gb=7)
    serve("big", memory_gb=8)
    reconcile.reconcile()
    first = Replica.objects.get()
    for _ in range(3):
        reconcile.reconcile()
    again = Replica.objects.get()
    assert (again.pk, again.since, again.cause) == (first.pk, first.since, "fewest")
    assert again.reason == "a: 7 GB free, needs 8"
