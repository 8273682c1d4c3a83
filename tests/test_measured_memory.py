"""Memory that is known: what agents measure reaches placement, making room and the admin."""

from __future__ import annotations

import time

import pytest

from catalog.memory import GB
from catalog.models import Model, Profile
from contracts import signing
from fleet import autoscale, reconcile, room
from fleet import memory as measured_memory
from fleet.models import MeasuredMemory, Node, Replica
from fleet.placement import ModelView, NodeView, ProfileView, ReplicaView, place
from fleet.tasks import heartbeat

from .support.factories import add_node as node
from .support.factories import add_served_model as serve

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_redis")]

SOURCE = "http://127.0.0.1:8001/tiny/v1/"


def beat(node_name: str, replica_memory: dict, available: int = 10 * GB) -> None:
    """A heartbeat as an agent sends it (agent/memory.py's facts), through the control plane's task."""
    facts = {
        "node": node_name,
        "engines": ["llamacpp"],
        "memory_gb": Node.objects.get(name=node_name).memory_gb,
        "replicas": [int(i) for i in replica_memory],
        "replica_memory": {str(i): m for i, m in replica_memory.items()},
        "memory_available_bytes": available,
    }
    heartbeat(signing.sign_message(signing.token_hash(f"token-of-{node_name}"), "fleet.heartbeat", node_name, facts))


def test_placement_refuses_a_node_that_fits_the_estimate_but_not_the_measured_figure():
    small = NodeView("small", engines=frozenset({"llamacpp"}), memory_gb=4)
    asked = ProfileView("cpu", "llamacpp", min_memory_gb=2)
    measured = ProfileView("cpu", "llamacpp", min_memory_gb=2, measured_gb=6)
    assert place([small], [ModelView("m", SOURCE, 1, (asked,))], []).assign
    plan = place([small], [ModelView("m", SOURCE, 1, (measured,))], [])
    assert not plan.assign
    assert plan.unplaced[0].reason == "small: 4 GB free, needs 6 (measured; the profile asks 2)"


def test_a_replica_is_booked_at_what_its_node_measured_once_that_is_more_than_it_asked():
    n = NodeView("n", engines=frozenset({"llamacpp"}), memory_gb=8)
    running = ReplicaView(1, "big", "cpu", "n", state="ready", memory_gb=2, measured_gb=7, source=SOURCE)
    other = ModelView("other", SOURCE, 1, (ProfileView("cpu", "llamacpp", min_memory_gb=2),))
    big = ModelView("big", SOURCE, 1, (ProfileView("cpu", "llamacpp", min_memory_gb=2),))
    plan = place([n], [big, other], [running])
    assert [u.reason for u in plan.unplaced] == ["n: 1 GB free, needs 2"]


def test_a_measured_figure_from_heartbeats_makes_the_reconcile_pass_refuse_the_node(settings):
    node("n1", memory_gb=8)
    serve("m", memory_gb=2, scaling_min=1, scaling_max=1)
    reconcile.reconcile()
    (replica,) = Replica.objects.all()
    assert replica.node.name == "n1" and replica.memory_gb == 2
    replica.enter("ready", endpoint="http://127.0.0.1:1/v1")
    replica.save()
    # Its engine holds 5.5 GB: the profile's highest figure is 6 GB from now on.
    beat("n1", {replica.pk: {"rss": int(5.6 * GB), "pss": int(5.5 * GB)}})
    peak = MeasuredMemory.objects.get(model_name="m", profile_name="cpu")
    assert (peak.host_bytes, peak.host_gb, peak.node_name) == (int(5.5 * GB), 6, "n1")
    # A second node of 4 GB fits the 2 GB the profile asks, not the 6 it uses.
    node("n2", memory_gb=4)
    Model.objects.filter(name="m").update(scaling_min=2, scaling_max=2)
    reconcile.reconcile()
    pending = Replica.objects.get(model_name="m", node__isnull=True)
    assert "n2: 4 GB free, needs 6 (measured; the profile asks 2)" in pending.reason
    # A lower figure later does not lower it; a new --ctx-size starts it again.
    beat("n1", {replica.pk: {"rss": 1 * GB, "pss": 1 * GB}})
    assert MeasuredMemory.objects.get().host_gb == 6


def test_a_node_cannot_report_memory_for_a_replica_on_another_node():
    node("n1")
    node("n2")
    serve("m", memory_gb=1)
    reconcile.reconcile()
    (replica,) = Replica.objects.all()
    other = "n2" if replica.node.name == "n1" else "n1"
    beat(other, {replica.pk: {"rss": 50 * GB}})
    assert not MeasuredMemory.objects.exists()
    measured, _ = measured_memory.latest(["n1", "n2"])
    views = reconcile.replica_views([replica], {n.pk: n.name for n in Node.objects.all()}, measured)
    assert views[0].measured_gb == 0


def test_making_room_stops_the_one_large_idle_replica_rather_than_three_small_ones():
    now = time.time()
    # Three small replicas idle longest, and one large one: 2 GB free, the waking model needs 8.
    candidates = [room.Candidate(i, f"small{i}", "n", 2, 0, 100, now - 3600 + i) for i in (1, 2, 3)]
    candidates.append(room.Candidate(4, "large", "n", 8, 0, 100, now, measured=True))
    spare = {"small1": 1, "small2": 1, "small3": 1, "large": 1}
    choice = room.choose(candidates, spare, {"n": (2, 0)}, {}, lambda node, memory, gpus: memory >= 8)
    assert [c.replica for c in choice.stop] == [4]
    # When the small ones are enough and as few, the one idle longest goes first.
    choice = room.choose(candidates, spare, {"n": (6, 0)}, {}, lambda node, memory, gpus: memory >= 8)
    assert [c.replica for c in choice.stop] == [1]


def test_making_room_goes_by_measured_memory_and_says_how_much_it_freed_and_for_whom():
    node("n1", memory_gb=16)
    for name in ("s1", "s2", "s3", "large"):
        serve(name, memory_gb=2, scaling_min=0, scaling_max=1)
    serve("waking", memory_gb=8, scaling_min=0, scaling_max=1)
    for name in ("s1", "s2", "s3", "large"):
        autoscale.wake(name, most=1, fewest=0)
    reconcile.reconcile()
    replicas = {r.model_name: r for r in Replica.objects.all()}
    for r in replicas.values():
        r.enter("ready", endpoint=f"http://127.0.0.1:1/{r.pk}/v1")
        r.save()
    # The small ones were asked for longest ago: idle longest.
    from fleet.models import Scale

    for i, name in enumerate(("s1", "s2", "s3")):
        Scale.objects.filter(model_name=name).update(last_request=time.time() - 3600 + i)
    # Booked at 2 GB each; the large one's engine really holds 7.5 GB.
    beat("n1", {r.pk: {"rss": (int(7.5 * GB) if name == "large" else GB)} for name, r in replicas.items()})
    autoscale.wake("waking", most=1, fewest=0)
    reconcile.reconcile()
    stopped = {r.model_name: r.reason for r in Replica.objects.filter(state="stopping")}
    assert stopped == {"large": "stopped to make room for waking: frees 8 GB on n1 (measured)"}


def test_an_under_asking_profile_gets_a_warning_with_the_number_to_raise_it_to(admin_client):
    node("n1", memory_gb=32)
    serve("m", memory_gb=2, scaling_min=1, scaling_max=1)
    reconcile.reconcile()
    (replica,) = Replica.objects.all()
    page = admin_client.get("/admin/fleet/replica/").content.decode()
    assert "raise its min memory" not in page
    beat("n1", {replica.pk: {"rss": int(4.2 * GB), "pss": int(4.1 * GB)}})
    page = admin_client.get("/admin/fleet/replica/").content.decode()
    assert "Profile cpu of m asks for 2 GB, and its replicas use 4.1 GB" in page
    assert "raise its min memory to 5 GB" in page
    page = admin_client.get("/admin/fleet/measuredmemory/").content.decode()
    assert "2 GB (raise to 5)" in page
    # Raised: no warning.
    Profile.objects.filter(model__name="m").update(min_memory_gb=5)
    assert "raise its min memory" not in admin_client.get("/admin/fleet/replica/").content.decode()


def test_the_replicas_page_shows_asked_estimate_and_measured_side_by_side(admin_client):
    node("n1", memory_gb=32)
    serve("m", memory_gb=2, scaling_min=1, scaling_max=1)
    reconcile.reconcile()
    (replica,) = Replica.objects.all()
    beat("n1", {replica.pk: {"rss": int(1.5 * GB), "pss": int(1.25 * GB), "gpu": 3 * GB}})
    page = admin_client.get("/admin/fleet/replica/").content.decode()
    assert '<td class="field-memory_asked">2 GB</td>' in page
    assert "RSS 1.5 GB · PSS 1.2 GB · GPU 3.0 GB" in page


def test_the_node_s_available_memory_from_its_heartbeat_is_on_its_admin_page(admin_client):
    node("n1", memory_gb=32)
    assert '<td class="field-memory_available">—</td>' in admin_client.get("/admin/fleet/node/").content.decode()
    beat("n1", {}, available=int(9.5 * GB))
    page = admin_client.get("/admin/fleet/node/").content.decode()
    assert '<td class="field-memory_available">9.5\xa0GB</td>' in page
