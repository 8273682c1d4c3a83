"""Work two control workers take at once (two control hosts, docs/fleet.md) is done once.

Each test runs the same work twice at the same moment, in two threads with database
connections of their own, as two control workers on two hosts would: a mirror scan, one
pull delivered twice, a collection of what the nodes posted, and a wake beside an
autoscaling write. And the scheduler's lease, taken as the control plane's Redis user.
(Placement's reconcile pass keeps to one at a time by its own locks:
tests/test_reconcile.py, test_a_pass_while_another_holds_the_lock_does_nothing.)
"""

from __future__ import annotations

import sys
import threading

import pytest
from django.db import connection, connections

from contracts import keys
from contracts import tasks as contract_tasks
from fleet import autoscale
from fleet.models import Scale
from mirror import pull, scan
from mirror import tasks as mirror_tasks
from mirror.models import MirrorPull

from .support.acl_redis import AclRedis
from .support.processes import Process, process_env
from .support.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def in_thread(target, *args) -> tuple[threading.Thread, list]:
    """`target(*args)` in a thread with a database connection of its own; its result lands in the list."""
    out: list = []

    def run():
        try:
            out.append(target(*args))
        except BaseException as error:  # the test reads it
            out.append(error)
        finally:
            connections.close_all()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


class Blocking:
    """Stands in for the long work: counts its calls, and the first waits until the test lets it go."""

    def __init__(self, result=None):
        self.calls = 0
        self.inside = threading.Event()
        self.go = threading.Event()
        self.result = result

    def __call__(self, *args, **kwargs):
        self.calls += 1
        self.inside.set()
        assert self.go.wait(timeout=30), "the test never let the work finish"
        return self.result() if callable(self.result) else self.result


def test_two_mirror_scans_at_once_scan_the_mirror_once(monkeypatch, mirror_root):
    if connection.vendor != "postgresql":
        pytest.skip("the control hosts' locks are PostgreSQL's advisory locks")
    work = Blocking(result=scan.ScanReport)
    monkeypatch.setattr(scan, "scan_mirror", work)
    first, first_out = in_thread(mirror_tasks.scan_task)
    assert work.inside.wait(timeout=20), "the first scan never began"
    second, second_out = in_thread(mirror_tasks.scan_task)
    second.join(timeout=20)
    assert second_out and "another scan is under way" in second_out[0], second_out
    work.go.set()
    first.join(timeout=20)
    assert work.calls == 1
    assert not isinstance(first_out[0], BaseException), first_out
    # Once the first is done, the lock is free: the next scan runs.
    assert "another scan is under way" not in mirror_tasks.scan_task()
    assert work.calls == 2


def test_one_pull_delivered_twice_at_once_runs_once_and_is_not_marked_failed_beneath_itself(monkeypatch, mirror_root):
    row = MirrorPull.objects.create(url="https://other.example.org/tiny/v1/", model="tiny", version="v1")

    def finished():
        MirrorPull.objects.filter(pk=row.pk).update(state=MirrorPull.State.DONE)

    work = Blocking(result=finished)
    monkeypatch.setattr(pull, "_pull", work)
    first, _ = in_thread(pull.run, row.pk)
    assert work.inside.wait(timeout=20), "the first delivery never began pulling"
    second, second_out = in_thread(pull.run, row.pk)
    second.join(timeout=20)
    assert not second.is_alive() and not isinstance(second_out[0], BaseException), second_out
    row.refresh_from_db()
    assert row.state == MirrorPull.State.RUNNING, (
        f"the second delivery marked the pull under way {row.state}: {row.error}"
    )
    work.go.set()
    first.join(timeout=20)
    row.refresh_from_db()
    assert (work.calls, row.state, row.error) == (1, MirrorPull.State.DONE, "")


def test_another_pull_of_a_version_being_pulled_is_refused_with_a_sentence(monkeypatch, mirror_root):
    one = MirrorPull.objects.create(url="https://other.example.org/tiny/v1/", model="tiny", version="v1")
    other = MirrorPull.objects.create(url="https://third.example.org/tiny/v1/", model="tiny", version="v1")
    work = Blocking()
    monkeypatch.setattr(pull, "_pull", work)
    first, _ = in_thread(pull.run, one.pk)
    assert work.inside.wait(timeout=20)
    try:
        pull.run(other.pk)
        other.refresh_from_db()
        assert other.state == MirrorPull.State.FAILED
        assert other.error == "another pull of tiny/v1 is under way; this one did nothing"
    finally:
        work.go.set()
        first.join(timeout=20)
    assert work.calls == 1


def test_two_collections_at_once_take_each_posted_heartbeat_and_report_once(redis_client):
    nodes = [f"n{i}" for i in range(300)]
    for node in nodes:
        redis_client.set(keys.heartbeat_key(node), f"beat of {node}")
        redis_client.hset(keys.reports_key(node), "7", f"report of {node}")
    start = threading.Barrier(2)
    taken: list[tuple[dict, dict, dict]] = []

    def collect():
        start.wait(timeout=10)
        taken.append(contract_tasks.take(redis_client, nodes))

    threads = [threading.Thread(target=collect) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    beats = [node for heartbeats, _, _ in taken for node in heartbeats]
    reports = [node for _, posted, _ in taken for node in posted]
    assert sorted(beats) == sorted(nodes) and sorted(reports) == sorted(nodes)


def test_a_wake_beside_an_autoscaling_write_keeps_the_count_that_write_made():
    Scale.objects.create(model_name="m", replicas=0, why="quiet")
    # An autoscaling write under way: the pass has the row and sets three replicas.
    holder = connections.create_connection("default")
    holder.set_autocommit(False)
    with holder.cursor() as cursor:
        cursor.execute("SELECT id FROM fleet_scale WHERE model_name = 'm' FOR UPDATE")
        cursor.execute("UPDATE fleet_scale SET replicas = 3, why = 'busy' WHERE model_name = 'm'")
    try:
        woken, out = in_thread(autoscale.wake, "m", 5, 0)

        def wake_waits_for_the_row() -> bool:
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()"
                )
                return cursor.fetchone()[0] > 0

        if connection.vendor == "postgresql":
            wait_until(wake_waits_for_the_row, what="the wake to wait on the row the autoscaling write holds")
        holder.commit()
        woken.join(timeout=20)
    finally:
        holder.close()
    assert out == [True]
    row = Scale.objects.get(model_name="m")
    assert (row.replicas, row.why) == (3, "busy"), "the wake wrote back the count it read before the write"
    assert row.last_request > 0


def test_the_scheduler_takes_its_lease_and_sends_as_the_control_planes_redis_user_with_nothing_refused(tmp_path):
    acl = AclRedis(tmp_path)
    env = process_env(REDIS_URL=acl.url_of("llmgw-control"), LLMGW_VAR=tmp_path, LLMGW_BEAT_LEASE_S=2)
    beat = Process(
        "beat", [sys.executable, "-m", "celery", "-A", "llmgw_site", "beat", "--loglevel", "INFO"], env, tmp_path
    )
    try:
        wait_until(
            lambda: "Sending due task fleet-reconcile" in beat.output() or not beat.alive(),
            timeout=60,
            what=lambda: f"the scheduler to send a reconcile:\n{beat.output()[-2000:]}",
        )
        assert "Acquired lock" in beat.output()
        assert acl.probe.get("llmgw:beat:lease"), "no lease in Redis"
        assert acl.denials() == []
        # Stopped cleanly, it gives the lease back: another host's scheduler need not wait for it to lapse.
        beat.stop()
        assert acl.probe.get("llmgw:beat:lease") is None
    finally:
        beat.stop()
        acl.stop()
