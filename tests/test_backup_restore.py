"""A control plane restored from its backup into a fresh database (issue 38 item 4), on the real agent and engine.

A node (a real agent, the real llama-server on the tiny GGUF) runs model a's replica and
model b's; `manage.py backup` is taken; then b is removed from the catalog (its engine
stopped) and a scaled to two. The database is dropped, made again empty, and `manage.py
restore` fills it; a new control worker starts. What the backup knew and still runs is
adopted as it runs (the same engine process), what runs but the backup did not know is
stopped, what the backup knew but no longer runs is started again, and the node goes on
with the token it had. A damaged archive, or one restored over a database in use, gives
a sentence and changes nothing.

A beat is played by the test: `fleet.reconcile` sent on the control queue every second.
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import tarfile
import threading
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest
from celery import current_app
from django.conf import settings
from django.core.management import CommandError, call_command
from django.db import connections

from agent import engine_state, engines
from catalog.models import Model, Profile
from common.backup import BackupError, read_archive
from contracts import tasks
from fleet.enrolment import issue_token
from fleet.models import Node, Replica
from launcher.demo_model import DEMO_MODEL, DEMO_VERSION, seed_mirror

from .support.processes import BASE_DIR, ask_replica, process_env, start_agent, start_celery_worker
from .support.waiting import wait_until

pytestmark = [pytest.mark.engine, pytest.mark.django_db(transaction=True)]


@contextmanager
def beat():
    """fleet.reconcile every second, as the beat sends it (settings.CELERY_BEAT_SCHEDULE, sooner)."""
    stop = threading.Event()

    def run():
        while not stop.wait(1.0):
            current_app.send_task(tasks.RECONCILE, queue=tasks.CONTROL_QUEUE)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5)


def manage(*args: str) -> subprocess.CompletedProcess:
    """`manage.py ARGS` as an operator runs it on the control-plane host (deploy/env/control.env)."""
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        env=process_env(),
        cwd=BASE_DIR,
        capture_output=True,
        text=True,
        timeout=300,
    )


def serve(name: str, source: str, replicas: int = 1) -> Model:
    model = Model.objects.create(
        name=name, source=source, context_length=256, scaling_min=replicas, scaling_max=replicas
    )
    Profile.objects.create(model=model, name="cpu", engine="llamacpp", args=["--ctx-size", "256"])
    return model


def ready(model: str, count: int) -> list[Replica]:
    def all_ready():
        found = list(Replica.objects.filter(model_name=model).select_related("node").order_by("pk"))
        return found if len(found) == count and all(r.state == "ready" for r in found) else None

    return wait_until(
        all_ready,
        timeout=120,
        interval=0.3,
        what=f"{count} ready replicas of {model}: {list(Replica.objects.values('id', 'model_name', 'state', 'reason'))}",
    )


def engine_pid(cache: Path, replica_id: int) -> int | None:
    entry = engine_state.read_state(cache)["replicas"].get(str(replica_id)) or {}
    return entry.get("pid") if entry.get("pid") and engines.group_alive(entry["pid"]) else None


def rows() -> list[tuple]:
    return list(Replica.objects.order_by("pk").values_list("pk", "model_name", "state", "endpoint"))


def drop_and_make_again() -> None:
    """The control plane's database gone and made again empty, as `dropdb` and `createdb` would."""
    db = settings.DATABASES["default"]
    for connection in connections.all():
        connection.close()
    with psycopg.connect(
        host=db["HOST"], port=db["PORT"], user=db["USER"], dbname="postgres", autocommit=True
    ) as admin:
        # FORCE: the byte listener of this test session holds a connection to it.
        admin.execute(f'DROP DATABASE "{db["NAME"]}" WITH (FORCE)')
        admin.execute(f'CREATE DATABASE "{db["NAME"]}"')


def test_a_restored_control_plane_adopts_what_its_backup_knew_and_stops_what_it_did_not(
    tmp_path, mirror_root, byte_listener, control_worker, settings, engine_cleanup
):
    if settings.DATABASES["default"]["ENGINE"] != "django.db.backends.postgresql":
        pytest.skip("drops and makes the database again with PostgreSQL's own statements")
    seed_mirror(mirror_root)
    source = f"{byte_listener}{DEMO_MODEL}/{DEMO_VERSION}/"
    settings.BYTES_URL = byte_listener
    cache = tmp_path / "cache-n1"
    agent = start_agent("n1", issue_token("n1"), cache, tmp_path, LLMGW_BYTES_URL=byte_listener)
    token_hash = Node.objects.get(name="n1").token_hash
    worker = control_worker
    try:
        with beat():
            model_a = serve("a", source)
            serve("b", source)
            (kept,), (gone,) = ready("a", 1), ready("b", 1)
            kept_pid, gone_pid = engine_pid(cache, kept.pk), engine_pid(cache, gone.pk)
            assert kept_pid and gone_pid

            archive = tmp_path / "control-plane.backup"
            made = manage("backup", str(archive))
            assert made.returncode == 0, made.stdout + made.stderr
            assert archive.stat().st_mode & 0o777 == 0o600
            with tarfile.open(archive) as held:
                manifest = json.loads(held.extractfile("manifest.json").read())
            assert manifest["database"] == "postgresql" and set(manifest["members"]) == {"database.pgdump"}
            assert "mirror" in manifest["not_in_the_archive"]

            # After the backup: b leaves the catalog (its engine is stopped), a gets a second replica.
            Model.objects.filter(name="b").delete()
            model_a.scaling_min = model_a.scaling_max = 2
            model_a.save()
            later = ready("a", 2)[1]
            later_pid = engine_pid(cache, later.pk)
            wait_until(lambda: engine_pid(cache, gone.pk) is None, timeout=60, what="b's engine to be stopped")
            assert later_pid and not Replica.objects.filter(model_name="b").exists()

        # A damaged archive, and the good one over a database in use: a sentence each, nothing changed.
        before = rows()
        damaged = tmp_path / "damaged.backup"
        data = bytearray(archive.read_bytes())
        middle = len(data) // 2
        data[middle : middle + 64] = bytes(64)
        damaged.write_bytes(bytes(data))
        refused = manage("restore", str(damaged))
        assert refused.returncode == 1 and "the archive is damaged" in refused.stderr, refused.stdout + refused.stderr
        assert "Traceback" not in refused.stderr, refused.stderr
        # The same sentences in this process, which saves starting Django twice more.
        for path, said in ((archive, "a restore goes into an empty one"), (tmp_path / "nothing-here", "is not a file")):
            with pytest.raises(CommandError, match=said):
                call_command("restore", str(path))
        assert rows() == before

        worker.stop()
        drop_and_make_again()
        restored = manage("restore", str(archive))
        assert restored.returncode == 0, restored.stdout + restored.stderr
        assert {(r[0], r[1]) for r in rows()} == {(kept.pk, "a"), (gone.pk, "b")}
        heard_before = Node.objects.get(name="n1").last_heartbeat
        # Its heartbeat's list is believed, once it is younger than the report it leaves out, after
        # HEARTBEAT_S * HEARTBEATS_MISSED (fleet/reconcile.py `unanswered_after`): 9 s here.
        worker = start_celery_worker(
            "control-restored", "control", tmp_path, LLMGW_MIRROR_ROOT=mirror_root, LLMGW_HEARTBEAT_S="3"
        )
        with beat():
            wait_until(
                lambda: engine_pid(cache, later.pk) is None,
                timeout=60,
                what="the replica the backup did not know to be stopped",
            )
            # The restored row says ready, as it was at the backup: its engine is what shows it started again.
            wait_until(
                lambda: engine_pid(cache, gone.pk) not in (None, gone_pid),
                timeout=90,
                interval=0.3,
                what=f"b's replica, known to the backup, to be started again: {rows()}",
            )
            again = wait_until(
                lambda: Replica.objects.filter(pk=gone.pk, state="ready").select_related("node").first(),
                timeout=60,
                interval=0.3,
                what=f"b's replica to be ready again: {rows()}",
            )

            # Adopted as it ran: the same engine process, ready at the same endpoint, answering.
            assert engine_pid(cache, kept.pk) == kept_pid
            adopted = Replica.objects.select_related("node").get(pk=kept.pk)
            assert (adopted.state, adopted.endpoint) == ("ready", kept.endpoint)
            ask_replica(adopted)
            ask_replica(again)
            assert {r[0] for r in rows()} == {kept.pk, gone.pk}, rows()
        # The node went on with its token: no new one, its heartbeats believed.
        node = Node.objects.get(name="n1")
        assert node.token_hash == token_hash and node.last_heartbeat > heard_before
        assert agent.alive(), agent.output()[-2000:]
        assert "Traceback" not in worker.output(), worker.output()[-3000:]
    finally:
        if worker is not control_worker:
            worker.stop()
        agent.stop()


def archive_of(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def test_an_archive_that_is_not_a_whole_llmgw_backup_is_refused_with_a_sentence_before_anything_is_written(tmp_path):
    dump = b"PGDMP not really"
    manifest = {"format": "llmgw-backup", "version": 1, "database": "postgresql"}
    cases = {
        "not-a-tar": (b"hello", "cannot be read as an llmgw backup"),
        "no-manifest": ({"database.pgdump": dump}, "it has no manifest.json"),
        "another-format": ({"manifest.json": b'{"format": "zip"}'}, "its manifest.json does not say llmgw-backup"),
        "a-newer-format": (
            {"manifest.json": json.dumps({**manifest, "version": 9}).encode()},
            "this llmgw reads format 1",
        ),
        "member-changed": (
            {
                "manifest.json": json.dumps({**manifest, "members": {"database.pgdump": "0" * 64}}).encode(),
                "database.pgdump": dump,
            },
            "does not match its manifest's SHA-256",
        ),
        "member-missing": (
            {"manifest.json": json.dumps({**manifest, "members": {"database.pgdump": "0" * 64}}).encode()},
            "is missing database.pgdump",
        ),
        "a-stranger-member": (
            {"manifest.json": json.dumps({**manifest, "members": {"../../etc/passwd": "0" * 64}}).encode()},
            "which no llmgw backup holds",
        ),
    }
    for name, (content, said) in cases.items():
        path = tmp_path / f"{name}.backup"
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            archive_of(path, content)
        unpacked = tmp_path / f"{name}-unpacked"
        unpacked.mkdir()
        with pytest.raises(BackupError, match=re.escape(said)):
            read_archive(path, unpacked)
        assert list(unpacked.iterdir()) == [], name
