"""PostgreSQL, the fleet's database: two control workers placing at the same moment.

SQLite serialises every writer at BEGIN (IMMEDIATE transactions), so two passes can
never read the same "no replica yet". PostgreSQL lets them, and that is where a
second control worker would place every replica again. These tests hold the
replica table locked while two real Celery workers start their passes, so both are
inside at once when it is released.
"""

import os

import psycopg
import pytest
from celery import current_app
from django.conf import settings
from django.db import connection
from django.utils import timezone

from catalog.models import Model, Profile
from contracts import signing
from fleet.models import Node, Replica
from fleet.reconcile import LOCK_NAME

from .support.processes import start_celery_worker
from .support.waiting import wait_until

ON_POSTGRES = os.environ.get("LLMGW_TEST_DATABASE", "postgres") == "postgres"
NODES = ("race-a", "race-b")
MODELS = ("race-one", "race-two", "race-three")


def test_the_suite_runs_on_the_database_it_was_told(db):
    expected = {"postgres": "postgresql", "sqlite": "sqlite"}[os.environ.get("LLMGW_TEST_DATABASE", "postgres")]
    assert connection.vendor == expected


def _dsn() -> str:
    db = settings.DATABASES["default"]
    return f"host={db['HOST']} port={db['PORT']} user={db['USER']} dbname={db['NAME']}"


def _waiting_on_locks(conn) -> int:
    """Sessions of the test database waiting for a lock (the replica table's, or the pass lock)."""
    return conn.execute(
        "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
        "WHERE NOT l.granted AND a.datname = current_database()"
    ).fetchone()[0]


@pytest.fixture
def race_catalog(transactional_db, redis_client):
    for name in NODES:
        Node.objects.create(
            name=name,
            engines=["llamacpp"],
            memory_gb=64,
            last_heartbeat=timezone.now(),
            token_hash=signing.token_hash(f"token-of-{name}"),
        )
    for name in MODELS:
        model = Model.objects.create(
            name=name, source=f"http://127.0.0.1:8001/{name}/v1/", context_length=512, scaling_min=2, scaling_max=2
        )
        Profile.objects.create(model=model, name="cpu", engine="llamacpp", min_memory_gb=1)
    # The catalog's writes queued reconciles on the control queue: not for this test's workers.
    redis_client.delete("control", *[f"node.{n}" for n in NODES])
    yield
    redis_client.delete(LOCK_NAME, "control", *[f"node.{n}" for n in NODES])


@pytest.mark.skipif(not ON_POSTGRES, reason="PostgreSQL only: SQLite takes its write lock at BEGIN")
@pytest.mark.parametrize("redis_lock", ["held", "expired"])
def test_two_control_workers_reconciling_at_once_place_each_replica_once(
    race_catalog, redis_client, tmp_path, redis_lock
):
    """`held`: the second pass finds the Redis lock and leaves the work to the first.
    `expired`: the Redis lock is gone while the first pass waits (it outlived its 60 s, or
    someone who reaches Redis deleted it), and the database's own lock must keep the two apart.
    """
    workers = [
        start_celery_worker(f"control-{side}", f"race-{side}", tmp_path, LLMGW_MIRROR_ROOT=tmp_path)
        for side in ("a", "b")
    ]
    try:
        with psycopg.connect(_dsn(), autocommit=True) as watcher, psycopg.connect(_dsn()) as blocker:
            blocker.execute("LOCK TABLE fleet_replica IN ACCESS EXCLUSIVE MODE")
            current_app.send_task("fleet.reconcile", queue="race-a")
            wait_until(lambda: _waiting_on_locks(watcher) >= 1, timeout=30, what="worker a's pass to start")
            if redis_lock == "expired":
                redis_client.delete(LOCK_NAME)
            current_app.send_task("fleet.reconcile", queue="race-b")
            # b either leaves at once (it found the Redis lock) or waits inside beside a.
            wait_until(
                lambda: " succeeded in " in workers[1].output() or _waiting_on_locks(watcher) >= 2,
                timeout=30,
                what="worker b's pass to start",
            )
            blocker.rollback()
        for worker in workers:
            wait_until(lambda w=worker: " succeeded in " in w.output(), timeout=30, what=f"{worker.name}'s pass")
        # What the passes said, before the workers stop: billiard's pool may print a traceback of its
        # own at a warm shutdown under load ("EOFError: Ran out of input" in _help_stuff_finish), which
        # is Celery's shutdown, not a pass.
        said = "".join(w.output() for w in workers)
    finally:
        for worker in workers:
            worker.stop()

    placed = sorted(Replica.objects.values_list("model_name", "node__name"))
    assert len(placed) == 2 * len(MODELS), placed
    assert sorted(name for name, _ in placed) == sorted(MODELS * 2)
    assert all(node in NODES for _, node in placed)
    # Each replica's start went out once: a second placement would have sent its own.
    starts = sum(redis_client.llen(f"node.{n}") for n in NODES)
    assert starts == 2 * len(MODELS), f"{starts} starts sent for {len(placed)} replicas"
    assert "Traceback" not in said, said
