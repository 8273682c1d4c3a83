"""Mirrors pull from mirrors (issue 24 item 5): a version copied from another llmgw site, whole or not at all.

Two sites, two real byte listeners on loopback, each with its own database: the central
one (a process of its own, on a SQLite database of its own, where this site is enrolled
as a node with `manage.py node_token`) and this site's (the session's byte listener, on
the test database). The pull runs as an operator runs it: `manage.py mirror_pull`, in this
process or as a process that is killed, or from the admin's page in chromium with a real
control worker.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import requests
from django.core.management import CommandError, call_command

from mirror import pull, scan
from mirror.models import MirrorPull

from .support.mirror import put
from .support.processes import (
    BASE_DIR,
    CONTROL_QUEUE,
    PULLS_QUEUE,
    CountingProxy,
    Process,
    as_node,
    process_env,
    start_byte_listener,
    start_celery_worker,
)
from .support.servers import LoopbackServer
from .support.waiting import wait_until

SITE = "site-b"  # this site's node name at the central one
FILES = {
    "config.json": b'{"architectures": ["LlamaForCausalLM"]}',
    "model-00001-of-00002.safetensors": os.urandom(3 << 20),
    "model-00002-of-00002.safetensors": os.urandom((5 << 20) + 12345),
}


class Central:
    """The other site: its mirror root, its byte listener's address, and the token it issued this site."""

    def __init__(self, tmp):
        self.root = tmp / "central-mirror"
        self.root.mkdir()
        database = f"sqlite:///{tmp / 'central.sqlite3'}"
        env = process_env(DATABASE_URL=database, LLMGW_MIRROR_ROOT=self.root)
        # A site of its own: its own database, migrated, and this site enrolled there as a node.
        subprocess.run(
            [sys.executable, "manage.py", "migrate", "--no-input", "-v", "0"], env=env, cwd=BASE_DIR, check=True
        )
        made = subprocess.run(
            [sys.executable, "manage.py", "node_token", SITE], env=env, cwd=BASE_DIR, check=True, capture_output=True
        )
        self.token = made.stdout.decode().strip().splitlines()[-1]
        self.process, self.url = start_byte_listener(self.root, tmp, DATABASE_URL=database)

    def manifest(self, model: str, version: str) -> dict:
        from contracts import credentials, signing

        key = signing.token_hash(self.token)
        answer = requests.get(
            f"{self.url}{model}/{version}/", headers=credentials.bearer(credentials.bytes_pass(key, SITE)), timeout=10
        )
        assert answer.status_code == 200, answer.text
        return answer.json()


@pytest.fixture(scope="module")
def central(tmp_path_factory, django_db_setup):
    site = Central(tmp_path_factory.mktemp("central"))
    yield site
    site.process.stop()


@pytest.fixture(autouse=True)
def plain_http_allowed(settings):
    """The test sites are on loopback, over plain http: allowed here as an operator allows it (LLMGW_PULL_ALLOW_HTTP)."""
    settings.PULL_ALLOW_HTTP = True


@pytest.fixture
def pull_worker(mirror_root, tmp_path, django_db_setup):
    """A control worker that takes pulls too (deploy's llmgw-pulls takes them on slots of their own), http allowed."""
    process = start_celery_worker(
        "control",
        f"{CONTROL_QUEUE},{PULLS_QUEUE}",
        tmp_path,
        LLMGW_MIRROR_ROOT=mirror_root,
        LLMGW_PULL_ALLOW_HTTP="true",
    )
    yield process
    process.stop()


@pytest.fixture
def credentials_in_env(central, monkeypatch, transactional_db):
    monkeypatch.setenv("LLMGW_PULL_TOKEN", central.token)


def _version_dirs(root):
    return sorted(
        f"{m.name}/{v.name}" for m in root.iterdir() if not m.name.startswith(".") for v in m.iterdir() if v.is_dir()
    )


def test_a_pulled_version_is_the_central_mirrors_byte_for_byte_and_this_mirror_serves_it(
    central, credentials_in_env, byte_listener, mirror_root
):
    put(central.root, "llama", "v1", FILES)
    call_command("mirror_pull", f"{central.url}llama/v1/", "--node", SITE)

    pulled = mirror_root / "llama" / "v1"
    assert {p.name: p.read_bytes() for p in pulled.iterdir()} == FILES
    # Nothing left behind in the staging folder.
    assert not (mirror_root / ".pull" / "llama" / "v1").exists()
    row = MirrorPull.objects.get()
    assert row.state == MirrorPull.State.DONE and row.bytes_done == sum(map(len, FILES.values()))
    assert row.pass_key == "", "the other site's credential is kept only while the pull runs"

    # This site's byte listener offers it at once (settled, hashed, with the same torrent as the central one).
    theirs = central.manifest("llama", "v1")
    ours = as_node.get(f"{byte_listener}llama/v1/", timeout=10)
    assert ours.status_code == 200, ours.text
    ours = ours.json()
    assert ours["files"] == theirs["files"]
    assert ours["torrent"]["info_hash"] == theirs["torrent"]["info_hash"]


def test_a_single_file_version_is_pulled_whole(central, credentials_in_env, mirror_root):
    put(central.root, "solo", "q4", {"solo.gguf": os.urandom((4 << 20) + 7)})
    call_command("mirror_pull", f"{central.url}solo/q4/", "--node", SITE)
    assert (mirror_root / "solo" / "q4" / "solo.gguf").read_bytes() == (central.root / "solo/q4/solo.gguf").read_bytes()


def test_a_pull_killed_halfway_leaves_no_version_and_the_next_goes_on_from_the_verified_pieces(
    central, byte_listener, mirror_root, tmp_path
):
    big = {"a.bin": os.urandom(24 << 20), "b.bin": os.urandom(24 << 20)}
    put(central.root, "big", "v1", big)
    # Slowed so that "halfway" lasts long enough to be seen: 6 MB/s for each request.
    proxy = CountingProxy(central.url, rate=6_000_000)
    try:
        env = process_env(LLMGW_PULL_TOKEN=central.token, LLMGW_MIRROR_ROOT=mirror_root, LLMGW_PULL_ALLOW_HTTP="true")
        argv = [sys.executable, "manage.py", "mirror_pull", f"{proxy.url}big/v1/", "--node", SITE]
        process = Process("mirror-pull", argv, env, tmp_path)
        total = sum(map(len, big.values()))

        def halfway():
            if not process.alive():
                raise AssertionError(f"the pull ended before it was killed:\n{process.output()}")
            row = MirrorPull.objects.first()
            return row is not None and 20 << 20 <= row.bytes_done < total - (8 << 20)

        wait_until(halfway, timeout=60, what=lambda: f"the pull to be halfway: {MirrorPull.objects.first()}")
        os.killpg(process.popen.pid, signal.SIGKILL)
        process.popen.wait()
        process.stop()

        # Nothing the mirror takes for a version: not on disk where a scan looks, not in the index, not served.
        assert _version_dirs(mirror_root) == []
        report = scan.scan_mirror()
        assert report.added == [] and report.skipped == []
        listing = as_node.get(byte_listener, timeout=10).json()
        assert listing == {"models": []}
        assert as_node.get(f"{byte_listener}big/v1/", timeout=10).status_code == 404
        assert (mirror_root / ".pull" / "big" / "v1").is_dir(), "the verified pieces are kept for the next pull"

        # Staff see it as interrupted once it has been silent a while (here, made to look 60 s old).
        from datetime import timedelta

        from django.utils import timezone

        killed = MirrorPull.objects.get()
        MirrorPull.objects.filter(pk=killed.pk).update(updated=timezone.now() - timedelta(seconds=60))
        killed.refresh_from_db()
        assert killed.description.startswith("interrupted: no word from it since")

        # The next pull goes on from what was verified: the proxy passes on what was missing only.
        proxy.reset_counts()
        proxy.rate = None
        record = pull.start(f"{proxy.url}big/v1/", SITE, central.token)
        killed.refresh_from_db()
        assert killed.pass_key == "", "the killed pull's credential is cleared by the next one"
        assert pull.run(record.pk).state == MirrorPull.State.DONE, MirrorPull.objects.get(pk=record.pk).error
        assert {p.name: p.read_bytes() for p in (mirror_root / "big" / "v1").iterdir()} == big
        # 20 MiB were verified when it was killed; libtorrent records what is verified every second.
        assert proxy.body_bytes < total - (8 << 20), f"{proxy.body_bytes:,} bytes passed on again of {total:,}"
    finally:
        proxy.stop()


def test_a_copy_whose_file_disagrees_with_the_manifest_is_not_put_in_the_mirror(
    central, credentials_in_env, mirror_root, monkeypatch
):
    """The manifest's sha256 is checked after libtorrent's pieces: a file the torrent and the manifest
    disagree on (here, the manifest as read says another sha256) is dropped, and no version appears."""
    put(central.root, "liar", "v1", {"a.bin": os.urandom(1 << 20)})
    real = pull.read_manifest

    def another_sha256(address, who, deadline):
        manifest = real(address, who, deadline)
        manifest.files = [(name, size, "0" * 64) for name, size, _ in manifest.files]
        return manifest

    monkeypatch.setattr(pull, "read_manifest", another_sha256)
    with pytest.raises(CommandError) as failed:
        call_command("mirror_pull", f"{central.url}liar/v1/", "--node", SITE)
    assert "a.bin's sha256 is" in str(failed.value) and "nothing was put in the mirror" in str(failed.value)
    assert _version_dirs(mirror_root) == []
    assert MirrorPull.objects.get().state == MirrorPull.State.FAILED


def _refusal(*args) -> str:
    with pytest.raises(CommandError) as refused:
        call_command("mirror_pull", *args)
    return str(refused.value)


def test_addresses_that_are_not_a_versions_are_refused_with_a_sentence(mirror_root, transactional_db):
    assert "names a file, not a version" in _refusal("http://central:8001/m/v1/model.gguf")
    assert "is not a version's address" in _refusal("http://central:8001/m/")
    assert "is not a version's address" in _refusal("http://central:8001/m/v1")
    assert "contains a path separator" in _refusal("http://central:8001/m/a%2Fb/")
    assert "'..' is not a name" in _refusal("http://central:8001/m/%2E%2E/")
    assert "is hidden" in _refusal("http://central:8001/.pull/v1/")
    assert "is not an address on a byte listener" in _refusal("ftp://central/m/v1/")
    assert "carries credentials" in _refusal("http://site-b:secret@central:8001/m/v1/")
    assert "give both" in _refusal("http://central:8001/m/v1/", "--node", SITE)
    assert MirrorPull.objects.count() == 0


def test_wrong_missing_or_no_credentials_and_a_missing_version_are_said(
    central, mirror_root, monkeypatch, transactional_db
):
    put(central.root, "creds", "v1", {"a.bin": b"a" * 100})
    url = f"{central.url}creds/v1/"
    monkeypatch.setenv("LLMGW_PULL_TOKEN", "llmgw-node-not-the-token")
    said = _refusal(url, "--node", SITE)
    assert f"refused this site's credentials (node {SITE})" in said and "not one of node site-b's current" in said
    monkeypatch.delenv("LLMGW_PULL_TOKEN")
    assert "presented no credentials" in _refusal(url)
    monkeypatch.setenv("LLMGW_PULL_TOKEN", central.token)
    assert "has no version creds/v2 (404)" in _refusal(f"{central.url}creds/v2/", "--node", SITE)
    assert MirrorPull.objects.count() == 0 and _version_dirs(mirror_root) == []


def test_an_html_page_where_a_manifest_was_expected_is_said(mirror_root, transactional_db):
    def html(handler, method):
        body = b"<!doctype html><html><body>Index of /m/v1/</body></html>"
        handler.send_response(200)
        handler.send_header("Content-Type", "text/html; charset=utf-8")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    server = LoopbackServer(html)
    try:
        assert "answered an HTML page, not a version's manifest" in _refusal(f"{server.url}m/v1/")
    finally:
        server.stop()


def test_a_version_this_mirror_has_is_never_replaced(central, credentials_in_env, mirror_root):
    put(central.root, "kept", "v1", {"a.bin": b"central"})
    put(mirror_root, "kept", "v1", {"a.bin": b"ours"})
    assert "this mirror already has kept/v1" in _refusal(f"{central.url}kept/v1/", "--node", SITE)
    assert (mirror_root / "kept" / "v1" / "a.bin").read_bytes() == b"ours"


def test_the_token_is_never_taken_from_the_command_line():
    """The token goes in LLMGW_PULL_TOKEN or --token-file: a command line is seen by every user of the host."""
    from mirror.management.commands.mirror_pull import Command

    options = {a.dest for a in Command().create_parser("manage.py", "mirror_pull")._actions}
    assert "token" not in options and "token_file" in options


@pytest.mark.browser
def test_staff_pull_a_version_from_the_admins_page_and_watch_it_arrive(
    central, mirror_root, pull_worker, staff_page, live_server
):
    """In chromium: the versions' list offers "Pull a version"; a wrong token is said on the form; the right
    one starts the pull on the control worker, whose progress the page and the versions' list show."""
    from .staff_browser import screenshot

    put(central.root, "paged", "v1", FILES)
    # Slowed, so that the page is seen while the pull is under way: 2 MB/s for each request.
    proxy = CountingProxy(central.url, rate=2_000_000)
    page = staff_page
    page.goto(live_server.url + "/admin/mirror/mirrorversion/")
    page.click("#pull-button")
    page.fill("#id_url", f"{proxy.url}paged/v1/")
    page.fill("#id_node", SITE)
    page.fill("#id_token", "llmgw-node-not-the-token")
    page.click("#pull-submit")
    page.wait_for_selector("#form-error")
    said = page.inner_text("#form-error")
    assert "Nothing was pulled" in said and f"refused this site's credentials (node {SITE})" in said
    assert page.input_value("#id_token") == "", "a token is never written back into the page"
    assert MirrorPull.objects.count() == 0

    page.fill("#id_token", central.token)
    page.click("#pull-submit")
    page.wait_for_selector("#pull-description[data-state=running]", timeout=30_000)
    # Under way, in the page as it polls: a part verified, the bar between the ends.
    page.wait_for_function(
        """() => {
          const bar = document.querySelector('#pull-progress'), said = document.querySelector('#pull-description');
          return said.dataset.state === 'running' && said.innerText.includes('bytes verified')
            && bar.value > 0 && bar.value < 100;
        }""",
        timeout=30_000,
    )
    page.wait_for_selector("#pull-description[data-state=done]", timeout=60_000)
    proxy.stop()
    assert "every file verified" in page.inner_text("#pull-description")
    assert page.get_attribute("#pull-progress", "value") == "100"
    screenshot(page, "mirror-pull-done")
    assert {p.name: p.read_bytes() for p in (mirror_root / "paged" / "v1").iterdir()} == FILES

    page.goto(live_server.url + "/admin/mirror/mirrorversion/")
    page.wait_for_selector(".pull-row[data-version='paged/v1'] .pull-state")
    assert page.inner_text(".pull-row[data-version='paged/v1'] .pull-state").startswith("done")
    assert "paged" in page.inner_text("#result_list")
    screenshot(page, "mirror-versions-with-pulls")


def test_a_manifest_naming_a_file_with_a_separator_or_without_a_sha256_is_refused(mirror_root, transactional_db):
    """Another server (or a forged one) answering at a version's address: the names and hashes it gives are checked."""
    answers = {}

    def manifest(handler, method):
        body = json.dumps(answers["manifest"]).encode()
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    server = LoopbackServer(manifest)
    try:
        answers["manifest"] = {
            "model": "m",
            "version": "v1",
            "files": [{"name": "../evil", "bytes": 1, "sha256": "0" * 64}],
        }
        assert "names a file this mirror cannot hold: '../evil' contains a path separator" in _refusal(
            f"{server.url}m/v1/"
        )
        answers["manifest"] = {"model": "m", "version": "v1", "files": [{"name": "a.bin", "bytes": 1}]}
        assert "gives a.bin no sha256" in _refusal(f"{server.url}m/v1/")
        answers["manifest"] = {"models": [{"name": "m", "url": f"{server.url}m/"}]}
        assert "is a listing of the other mirror, not a version's address" in _refusal(f"{server.url}m/v1/")
    finally:
        server.stop()
    assert _version_dirs(mirror_root) == [] and MirrorPull.objects.count() == 0
