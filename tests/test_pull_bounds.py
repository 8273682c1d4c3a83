"""Pulls from another mirror are bounded (issue 34 item 9): a deadline, a queue of their own, the disk's room, https.

The other mirror is a real HTTP server on 127.0.0.1 (tests/support/other_mirror.py) that
answers as a byte listener does and sends as slowly as a test says: a byte a second, the
way a server can hold a pull for hours without ever tripping a read timeout. And the byte
listener's own bound (issue 34 item 10, issue 41 item 1): set up as deploy/ says, it answers
the Host a node sends and refuses another with a sentence.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from mirror import pull
from mirror.models import MirrorPull

from .support.mirror import put
from .support.other_mirror import OtherMirror
from .support.processes import (
    BASE_DIR,
    as_node,
    env_file,
    start_byte_listener,
    start_celery_worker,
    start_pulls_worker,
)
from .support.waiting import wait_until

DEPLOY = BASE_DIR / "deploy"


@pytest.fixture
def other(tmp_path):
    mirror = OtherMirror(tmp_path / "other-site")
    yield mirror
    mirror.stop()


@pytest.fixture
def here(tmp_path, settings) -> Path:
    """This site's mirror, pulling from loopback over plain http as an operator allows it (LLMGW_PULL_ALLOW_HTTP)."""
    root = tmp_path / "mirror"
    root.mkdir()
    settings.MIRROR_ROOT = root
    settings.PULL_ALLOW_HTTP = True
    settings.PULL_RESERVE_BYTES = 1 << 20
    return root


@pytest.fixture
def small_disk(tmp_path, settings) -> Path:
    """This site's mirror on a filesystem of its own, 8 MiB (a tmpfs; the tests run as root)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root, as the suite runs")
    root = tmp_path / "small-disk"
    root.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", str(root)], check=True)
    settings.MIRROR_ROOT = root
    settings.PULL_ALLOW_HTTP = True
    settings.PULL_RESERVE_BYTES = 1 << 20
    yield root
    subprocess.run(["umount", "--lazy", str(root)], check=True)


def _run(record: MirrorPull, within: float) -> tuple[MirrorPull, float]:
    """pull.run in a thread (its own connection: the test's database is transactional), waited on for at most
    `within` s: the old code held on for many minutes."""
    ended: list[MirrorPull] = []
    started = time.monotonic()

    def run() -> None:
        from django.db import connection

        try:
            ended.append(pull.run(record.pk))
        finally:
            connection.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(within)
    assert ended, f"the pull of {record.url} was still running after {within:g} s"
    return ended[0], time.monotonic() - started


def _nothing_of(root: Path, model: str, version: str) -> None:
    assert not (root / model / version).exists(), "nothing half-written is taken for a version"
    assert not (root / ".pull" / model / version).exists(), "its copy so far is removed"
    assert not (root / ".pull" / model / f"{version}.resume").exists()


@pytest.mark.django_db(transaction=True)
def test_a_pull_from_a_server_that_sends_a_byte_a_second_stops_at_its_deadline_and_leaves_nothing(
    other, here, settings
):
    address = other.add("slow", "v1", {"a.bin": os.urandom(256 << 10)})
    other.file_rate = 1
    settings.PULL_DEADLINE_S = 4
    ended, took = _run(pull.start(address), within=40)

    assert ended.state == MirrorPull.State.FAILED
    assert ended.error.startswith("the pull did not finish within 4 s (LLMGW_PULL_DEADLINE_S)"), ended.error
    assert "nothing of it is in the mirror" in ended.error
    assert ended.bytes_total == 256 << 10, "it was copying: the manifest and the torrent came at once"
    assert other.file_bytes_sent < 100, "the file's bytes trickled"
    assert took < 20
    _nothing_of(here, "slow", "v1")


@pytest.mark.django_db(transaction=True)
def test_a_manifest_sent_a_byte_a_second_holds_a_pull_no_longer_than_its_deadline(other, here, settings):
    """The trickle in the manifest's body: a read timeout counts from the last byte, and never fires."""
    address = other.add("slow", "v2", {"a.bin": b"a" * 1000})
    record = pull.start(address)
    other.manifest_rate = 1
    settings.PULL_DEADLINE_S = 3
    ended, took = _run(record, within=40)

    assert ended.state == MirrorPull.State.FAILED
    assert ended.error.startswith("the pull did not finish within 3 s (LLMGW_PULL_DEADLINE_S)"), ended.error
    assert took < 15
    _nothing_of(here, "slow", "v2")


@pytest.mark.django_db
@pytest.mark.parametrize("scheme", ["http", "https"])
def test_the_check_inside_the_admins_request_gives_up_on_a_server_that_never_answers(here, settings, scheme):
    """The pull page checks the address in its request: a server that accepts and says nothing (not even
    its side of the TLS handshake) holds it seconds, not the minute of a read timeout."""
    silent = socket.create_server(("127.0.0.1", 0))
    held = []
    threading.Thread(target=lambda: held.append(silent.accept()), daemon=True).start()
    settings.PULL_CHECK_S = 2
    started = time.monotonic()
    try:
        with pytest.raises(pull.PullError) as refused:
            pull.start(f"{scheme}://127.0.0.1:{silent.getsockname()[1]}/m/v1/")
    finally:
        silent.close()
    took = time.monotonic() - started
    assert held, "the server accepted the connection"
    assert "did not answer within 2 s (LLMGW_PULL_CHECK_S)" in str(refused.value)
    assert "nothing was pulled" in str(refused.value)
    assert took < 10, f"the check held the request {took:.1f} s"
    assert MirrorPull.objects.count() == 0


@pytest.mark.django_db
def test_plain_http_is_refused_with_a_sentence_unless_the_operator_allows_it(settings, tmp_path):
    settings.MIRROR_ROOT = tmp_path
    settings.PULL_ALLOW_HTTP = False
    with pytest.raises(pull.PullError) as refused:
        pull.start("http://central.example.org:8001/m/v1/")
    said = str(refused.value)
    assert said.startswith("http://central.example.org:8001/m/v1/ is plain http: a pull goes over https only")
    assert "LLMGW_PULL_ALLOW_HTTP=true" in said
    assert pull.parse_address("https://central.example.org:8001/m/v1/").model == "m"
    settings.PULL_ALLOW_HTTP = True
    assert pull.parse_address("http://central.example.org:8001/m/v1/").version == "v1"
    assert MirrorPull.objects.count() == 0


@pytest.mark.django_db(transaction=True)
def test_a_pull_the_disk_cannot_hold_is_refused_before_anything_is_staged(other, small_disk):
    big = other.add("big", "v1", {"a.bin": os.urandom(10 << 20)})
    with pytest.raises(pull.PullError) as refused:
        pull.start(big)
    said = str(refused.value)
    assert said.startswith("the mirror's disk has ") and "big/v1 needs 10.0\xa0MB" in said, said
    assert "kept free beside it (LLMGW_PULL_RESERVE_MB): nothing was pulled" in said
    assert MirrorPull.objects.count() == 0

    # Room when it was asked for, none when it runs: refused again, still before staging.
    fits = other.add("fits", "v1", {"a.bin": os.urandom(5 << 20)})
    record = pull.start(fits)
    (small_disk / ".filler").write_bytes(b"\0" * (4 << 20))
    ended, _ = _run(record, within=30)
    assert ended.state == MirrorPull.State.FAILED and ended.error.startswith("the mirror's disk has "), ended.error
    assert other.file_bytes_sent == 0
    _nothing_of(small_disk, "fits", "v1")


@pytest.mark.django_db(transaction=True)
def test_a_pull_whose_disk_fills_during_the_copy_stops_with_a_sentence_and_removes_its_copy(other, small_disk):
    address = other.add("filling", "v1", {"a.bin": os.urandom(6 << 20)})
    record = pull.start(address)
    other.file_rate = 1 << 20
    # Someone else's copy lands on the same disk once a megabyte of the pull has arrived.
    other.when_sent = (1 << 20, lambda: (small_disk / ".filler").write_bytes(b"\0" * (4 << 20)))
    ended, _ = _run(record, within=60)

    assert ended.state == MirrorPull.State.FAILED
    assert ended.error.startswith("the mirror's disk ran out of room during the pull:"), ended.error
    assert "the copy so far is removed and nothing of it is in the mirror" in ended.error
    _nothing_of(small_disk, "filling", "v1")


def test_two_pulls_that_trickle_leave_the_control_worker_free_to_place(other, here, tmp_path, transactional_db, broker):
    """Pulls run on the pulls worker (llmgw-pulls), so two that take hours leave placement its slots."""
    from celery import current_app

    env = {"LLMGW_MIRROR_ROOT": str(here), "LLMGW_PULL_ALLOW_HTTP": "true", "LLMGW_PULL_DEADLINE_S": "12"}
    control = start_celery_worker("control", "control", tmp_path, **env)
    pulls = start_pulls_worker(tmp_path, **env)
    try:
        other.file_rate = 1
        from mirror.tasks import pull_task

        records = [pull.start(other.add("slow", version, {"a.bin": os.urandom(64 << 10)})) for version in ("a", "b")]
        for record in records:
            pull_task.delay(record.pk)
        wait_until(
            lambda: MirrorPull.objects.filter(state=MirrorPull.State.RUNNING).count() == 2,
            timeout=30,
            what=lambda: f"both pulls to run: {list(MirrorPull.objects.values_list('state', flat=True))}",
        )
        current_app.send_task("fleet.reconcile")
        wait_until(
            lambda: re.search(r"Task fleet\.reconcile\[[^\]]+\] succeeded", control.output()),
            timeout=20,
            what=lambda: f"a placement pass on the control worker while two pulls trickle:\n{control.output()}",
        )
        assert MirrorPull.objects.filter(state=MirrorPull.State.RUNNING).count() == 2, "they were still running"
        assert "Task mirror.pull[" not in control.output() and "Task mirror.pull[" in pulls.output()

        # And the pulls worker ends them at their deadline, with the sentence on each.
        wait_until(
            lambda: MirrorPull.objects.filter(state=MirrorPull.State.FAILED).count() == 2,
            timeout=40,
            what=lambda: f"both pulls to stop at their deadline:\n{pulls.output()}",
        )
        for record in MirrorPull.objects.all():
            assert record.error.startswith("the pull did not finish within 12 s (LLMGW_PULL_DEADLINE_S)"), record.error
            _nothing_of(here, "slow", record.version)
    finally:
        pulls.stop()
        control.stop()


def _unit_env_file(unit: str) -> dict[str, str]:
    said = dict(line.split("=", 1) for line in (DEPLOY / "systemd" / unit).read_text().splitlines() if "=" in line)
    return env_file(Path(said["EnvironmentFile"]).stem)


def test_a_byte_listener_set_up_as_deploy_says_answers_the_host_nodes_send_and_refuses_another(
    fleet_node, tmp_path, django_db_setup
):
    """Its env file (llmgw-bytes.service's) and a node's (node.env) agree on its host; manifests name that host."""
    bytes_env = _unit_env_file("llmgw-bytes.service")
    nodes_reach = urlsplit(env_file("node")["LLMGW_BYTES_URL"])
    allowed = bytes_env.get("LLMGW_BYTES_ALLOWED_HOSTS") or urlsplit(bytes_env["LLMGW_BYTES_URL"]).hostname
    assert nodes_reach.hostname in allowed.split(","), "a node's Host must be one the byte listener answers"

    root = tmp_path / "mirror"
    put(root, "m", "v1", {"a.bin": b"weights"})
    process, url = start_byte_listener(
        root,
        tmp_path,
        DJANGO_ALLOWED_HOSTS=bytes_env["DJANGO_ALLOWED_HOSTS"],
        LLMGW_BYTES_URL=bytes_env["LLMGW_BYTES_URL"],
    )
    try:

        def manifest():
            # 503 "not ready" while its hash and torrent are made; 200 then.
            answer = as_node.get(f"{url}m/v1/", headers={"Host": nodes_reach.netloc}, timeout=10)
            assert answer.status_code in (200, 503), answer.text
            return answer if answer.status_code == 200 else None

        answer = wait_until(manifest, what="the version's manifest, asked with the Host a node sends")
        assert answer.json()["torrent"]["url"] == f"http://{nodes_reach.netloc}/m/v1/?torrent"

        admins_name = bytes_env["DJANGO_ALLOWED_HOSTS"].split(",")[0]
        refused = as_node.get(f"{url}m/v1/", headers={"Host": admins_name}, timeout=10)
        assert refused.status_code == 400
        said = refused.json()["error"]
        assert f"not the Host {admins_name!r}" in said and "LLMGW_BYTES_URL" in said, said
    finally:
        process.kill()  # gunicorn's graceful stop takes seconds, and nothing here needs it
        process.stop()


@pytest.mark.django_db(transaction=True)
def test_a_pull_that_cannot_make_its_staging_folder_fails_with_a_sentence_and_leaves_nothing(other, here):
    """Issue 41: a worker that may not write the mirror left the pull's row as it was, with a traceback in its log."""
    address = other.add("blocked", "v1", {"a.bin": b"a" * 1000})
    record = pull.start(address)
    (here / ".pull").write_text("not a folder")  # so the staging folder cannot be made, as on a read-only mirror

    ended, _ = _run(record, within=30)

    assert ended.state == MirrorPull.State.FAILED
    assert ended.error.startswith(f"the pull could not make its staging folder {here / '.pull' / 'blocked'}"), (
        ended.error
    )
    assert "this worker may not write the mirror" in ended.error and "nothing was pulled" in ended.error
    assert not (here / "blocked").exists()
