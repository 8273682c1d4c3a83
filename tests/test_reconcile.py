"""The reconcile pass against the real database and broker: rows written, agents told.

The catalog is given as snapshots (`ModelView`), the same thing the pass reads
from the catalog app, so these tests need no catalog rows.
"""

import time
from datetime import timedelta

import pytest
import redis
from django.conf import settings
from django.utils import timezone

from contracts import credentials, demand
from fleet import drain, reconcile
from fleet.live import LISTENING_KEY
from fleet.models import Node, Replica
from fleet.placement import ModelView, ProfileView

from .support.factories import add_node as node
from .support.fleet import sent

pytestmark = pytest.mark.django_db(transaction=True)

SOURCE = "http://127.0.0.1:8001/tiny/v1/"
CPU = ProfileView("cpu", "llamacpp", args=("--ctx-size", "512"), min_memory_gb=8)


def tiny(replicas: int = 1) -> list[ModelView]:
    return [ModelView("tiny", SOURCE, replicas, (CPU,))]


def start_of(replica_id: int, args: tuple[str, ...] = ("--ctx-size", "512")) -> tuple:
    # The catalog's name goes with it: a vLLM engine serves under it, and refuses any other.
    # And the nonce of the engine's secret: the replica's creation time (contracts.credentials).
    nonce = credentials.replica_nonce(Replica.objects.get(pk=replica_id).created)
    # SOURCE is not on this mirror, so no header bounds llama-server's prompt cache: none (catalog.memory).
    sent = [*args, "--cache-ram", "0"]
    return ("agent.start_replica", [replica_id, SOURCE, "llamacpp", sent], {"model": "tiny", "nonce": nonce})


def test_a_replica_is_written_and_its_node_told_to_start_it(broker):
    node("a")
    reconcile.reconcile(models=tiny())
    replica = Replica.objects.get()
    assert (replica.model_name, replica.profile_name, replica.node.name, replica.state) == (
        "tiny",
        "cpu",
        "a",
        "pending",
    )
    assert (replica.source, replica.engine, replica.args, replica.memory_gb) == (
        SOURCE,
        "llamacpp",
        ["--ctx-size", "512"],
        8,
    )
    assert sent(broker, "node.a") == [start_of(replica.pk)]
    # A second pass finds the model at its count and sends nothing.
    reconcile.reconcile(models=tiny())
    assert Replica.objects.count() == 1
    assert sent(broker, "node.a") == []


def test_a_replica_that_fits_nowhere_is_one_pending_row_that_says_why(broker):
    node("cpu-1", memory_gb=7)
    Node.objects.create(name="gpu-2", engines=["vllm"], memory_gb=64, last_heartbeat=timezone.now())
    for _ in range(3):
        reconcile.reconcile(models=tiny())
    replica = Replica.objects.get()
    assert replica.node is None and replica.state == "pending"
    assert replica.reason == "cpu-1: 7 GB free, needs 8; gpu-2: no llamacpp"
    assert broker.keys("node.*") == []


def test_a_node_that_stops_heartbeating_has_its_replica_placed_elsewhere(broker):
    a = node("a")
    reconcile.reconcile(models=tiny())
    replica = Replica.objects.get()
    replica.state = "ready"
    replica.endpoint = "http://a:9000/v1"
    replica.save()
    sent(broker, "node.a")

    node("b")
    Node.objects.filter(pk=a.pk).update(last_heartbeat=timezone.now() - timedelta(minutes=5))
    # The control plane has been listening all along (test_a_restarted_control_plane_... is the other case).
    broker.hset(LISTENING_KEY, mapping={"last": time.time(), "since": time.time() - 600})
    reconcile.reconcile(models=tiny())
    replica.refresh_from_db()
    assert (replica.node.name, replica.state, replica.endpoint) == ("b", "pending", "")


def test_a_restarted_control_plane_does_not_take_a_node_it_could_not_hear_for_lost(broker):
    """Silence while the control plane was down is not the node's: its first pass forgives it for a deadline."""
    a = node("a")
    reconcile.reconcile(models=tiny())
    replica = Replica.objects.get()
    replica.state, replica.endpoint = "ready", "http://a:9000/v1"
    replica.save()
    node("b")
    Node.objects.filter(pk=a.pk).update(last_heartbeat=timezone.now() - timedelta(minutes=5))
    # Its last pass ten minutes ago: the worker (or Redis) was down since.
    broker.hset(LISTENING_KEY, mapping={"last": time.time() - 600, "since": time.time() - 3600})
    reconcile.reconcile(models=tiny())
    replica.refresh_from_db()
    assert (replica.node.name, replica.state) == ("a", "ready")
    # Still silent a deadline after the control plane came back: lost, and placed on b.
    deadline_s = settings.HEARTBEAT_S * settings.HEARTBEATS_MISSED
    broker.hset(LISTENING_KEY, mapping={"last": time.time(), "since": time.time() - deadline_s - 1})
    reconcile.reconcile(models=tiny())
    replica.refresh_from_db()
    assert (replica.node.name, replica.state) == ("b", "pending")
    assert sent(broker, "node.b") == [start_of(replica.pk)]


def test_scaling_down_stops_a_replica_and_its_stopped_report_removes_it(broker):
    node("a")
    node("b")
    reconcile.reconcile(models=tiny(2))
    assert sorted(Replica.objects.values_list("node__name", flat=True)) == ["a", "b"]
    sent(broker, "node.a"), sent(broker, "node.b")

    reconcile.reconcile(models=tiny(1))
    stopping = Replica.objects.get(state="stopping")
    assert sent(broker, f"node.{stopping.node.name}") == [("agent.stop_replica", [stopping.pk])]
    reconcile.record_report(stopping.node, stopping.pk, "stopped", "", "")
    assert Replica.objects.count() == 1


def test_a_model_deleted_from_the_catalog_has_its_replicas_stopped(broker):
    node("a")
    reconcile.reconcile(models=tiny())
    sent(broker, "node.a")
    reconcile.reconcile(models=[])
    replica = Replica.objects.get()
    assert replica.state == "stopping"
    assert replica.model_name == "tiny"
    assert sent(broker, "node.a") == [("agent.stop_replica", [replica.pk])]


def test_a_failed_replica_is_started_again_after_its_backoff(broker):
    node("a")
    reconcile.reconcile(models=tiny())
    replica = Replica.objects.get()
    sent(broker, "node.a")
    reconcile.record_report(replica.node, replica.pk, "failed", "", "the engine exited with code 1")
    replica.refresh_from_db()
    assert replica.attempts == 1

    reconcile.reconcile(models=tiny(), now=replica.since + timedelta(seconds=5))
    assert sent(broker, "node.a") == []
    reconcile.reconcile(models=tiny(), now=replica.since + reconcile.retry_delay(1))
    assert sent(broker, "node.a") == [start_of(replica.pk)]
    replica.refresh_from_db()
    assert replica.state == "pending"
    assert replica.reason == "starting again after: the engine exited with code 1"


def test_retries_wait_longer_after_each_failure_up_to_a_limit():
    assert [reconcile.retry_delay(n).total_seconds() for n in (1, 2, 3, 10)] == [10, 20, 40, 600]


def test_a_pass_while_another_holds_the_lock_does_nothing(broker):
    node("a")
    lock = redis.Redis.from_url(settings.REDIS_URL).lock(reconcile.LOCK_NAME, timeout=10)
    assert lock.acquire(blocking=False)
    try:
        assert reconcile.reconcile(models=tiny()) is None
        assert Replica.objects.count() == 0
    finally:
        lock.release()


def test_a_node_that_reported_the_weights_fetched_is_preferred(broker):
    from fleet.models import Fetch

    node("a")
    holder = node("b")
    Fetch.objects.record(holder, {"source": SOURCE, "state": "complete", "path": "/cache/tiny/v1"})
    reconcile.reconcile(models=tiny())
    assert Replica.objects.get().node.name == "b"


def test_a_failed_fetch_does_not_count_as_holding_the_weights(broker):
    from fleet.models import Fetch

    node("a")
    failed = node("b")
    Fetch.objects.record(failed, {"source": SOURCE, "state": "failed", "error": "the mirror answered 404"})
    reconcile.reconcile(models=tiny())
    assert Replica.objects.get().node.name == "a"


def test_an_edited_profile_is_rolled_out_the_old_replica_stopping_once_the_new_one_is_ready(broker):
    node("a", memory_gb=64)
    reconcile.reconcile(models=tiny())
    old = Replica.objects.get()
    reconcile.record_report(old.node, old.pk, "ready", "http://127.0.0.1:9000/v1", "")
    sent(broker, "node.a")

    edited = [
        ModelView("tiny", SOURCE, 1, (ProfileView("cpu", "llamacpp", args=("--ctx-size", "4096"), min_memory_gb=8),))
    ]
    reconcile.reconcile(models=edited)
    new = Replica.objects.exclude(pk=old.pk).get()
    assert new.args == ["--ctx-size", "4096"]
    assert Replica.objects.get(pk=old.pk).state == "ready"  # still serving meanwhile
    assert sent(broker, "node.a") == [start_of(new.pk, ["--ctx-size", "4096"])]

    reconcile.record_report(new.node, new.pk, "ready", "http://127.0.0.1:9001/v1", "")
    # A gateway's load: the model answers a request, on the new replica, none on the old.
    snapshot = {"at": time.time(), "models": {"tiny": {"in_flight": 1, "waiting": 0, "last_request": time.time()}}}
    redis.Redis.from_url(settings.REDIS_URL).hset(
        demand.LOAD_KEY, "test-gateway", demand.encode({**snapshot, "replicas": {str(new.pk): 1}})
    )
    reconcile.reconcile(models=edited)
    assert Replica.objects.get(pk=old.pk).state == "stopping"
    # Not told at once, though no gateway's load says a request is on it: a gateway that has
    # not re-read its table may still send it one (fleet/drain.py). Before, it was stopped
    # at once, and a stream sent it meanwhile was cut (tests/test_rolling_replacement.py).
    assert sent(broker, "node.a") == []
    reconcile.reconcile(models=edited, now=timezone.now() + timedelta(seconds=drain.SETTLE_S / 2))
    assert sent(broker, "node.a") == []
    reconcile.reconcile(models=edited, now=timezone.now() + timedelta(seconds=drain.SETTLE_S + 1))
    assert sent(broker, "node.a") == [("agent.stop_replica", [old.pk])]
