"""The demo model `make run` puts into the mirror: once, whole or not at all, and never over someone's files."""

import os
import subprocess
import sys

import pytest

from launcher import demo_model
from launcher.services import ensure_demo_model
from mirror import disk, scan
from mirror.models import MirrorVersion
from serving.services import plan_for

from .support.mirror import listing, put
from .support.processes import BASE_DIR

pytestmark = pytest.mark.django_db

PARTS = ["tiny-00001-of-00003.gguf", "tiny-00002-of-00003.gguf", "tiny-00003-of-00003.gguf"]


def test_the_demo_model_is_written_once_as_three_gguf_parts_and_the_admin_shows_it_at_once(mirror_root, demo_on):
    note = ensure_demo_model()
    version_dir = mirror_root / "tiny-demo" / "v1"
    assert note == f"Demo model (random weights): written to {version_dir}; serve it from the admin's Mirror versions."
    assert listing(mirror_root) == ["tiny-demo"]
    assert listing(version_dir) == PARTS
    indexed = MirrorVersion.objects.with_totals().get(model="tiny-demo", version="v1")
    assert indexed.file_count == 3
    written = {p.name: os.stat(p).st_mtime_ns for p in version_dir.iterdir()}

    assert ensure_demo_model() == f"Demo model: {mirror_root / 'tiny-demo'} was there already, so it is left as it is."
    assert {p.name: os.stat(p).st_mtime_ns for p in version_dir.iterdir()} == written


def test_the_serve_page_offers_the_demo_model_to_llama_cpp_as_a_set_named_tiny_demo(mirror_root, demo_on, settings):
    settings.BYTES_URL = "http://127.0.0.1:8001/"
    ensure_demo_model()
    plan = plan_for(MirrorVersion.objects.get(model="tiny-demo", version="v1"))
    assert (plan.model, plan.engine, plan.profile, plan.files) == ("tiny-demo", "llamacpp", "cpu", 3)
    assert plan.source == "http://127.0.0.1:8001/tiny-demo/v1/"
    # The header's estimate (a few hundred KB of weights and the engine's own), in whole GB.
    assert plan.refusal == "" and plan.min_memory_gb == 1
    assert plan.memory["source"] == "header"


def test_while_the_demo_model_is_written_the_mirror_shows_no_part_of_it(mirror_root, monkeypatch):
    seen = {}
    write = demo_model.write_tiny_llama

    def write_and_look(directory, *args, **kwargs):
        parts = write(directory, *args, **kwargs)
        # Every part is on disk now, in the staging directory; nothing of it may show yet.
        seen["models"] = disk.model_names()
        seen["report"] = scan.scan_mirror()
        return parts

    monkeypatch.setattr(demo_model, "write_tiny_llama", write_and_look)
    assert demo_model.seed_mirror(mirror_root) == mirror_root / "tiny-demo" / "v1"
    assert seen["models"] == []
    assert (seen["report"].added, seen["report"].skipped) == ([], [])
    assert listing(mirror_root) == ["tiny-demo"]


def test_a_write_that_fails_halfway_leaves_nothing_and_the_next_start_writes_it_whole(mirror_root, monkeypatch):
    def fail_after_one_part(directory, *args, **kwargs):
        directory.mkdir(parents=True)
        (directory / PARTS[0]).write_bytes(b"GGUF")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(demo_model, "write_tiny_llama", fail_after_one_part)
    with pytest.raises(OSError):
        demo_model.seed_mirror(mirror_root)
    assert listing(mirror_root) == []
    monkeypatch.undo()

    # A start killed outright leaves its staging directory; the next one starts it afresh.
    put(mirror_root, ".tiny-demo.tmp", "v1", {PARTS[0]: b"GGUF", "stray.gguf": b"GGUF"})
    demo_model.seed_mirror(mirror_root)
    assert listing(mirror_root) == ["tiny-demo"]
    assert listing(mirror_root / "tiny-demo" / "v1") == PARTS


def test_a_full_disk_is_said_in_one_line_and_does_not_stop_the_start(mirror_root, demo_on, monkeypatch):
    def full(directory, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(demo_model, "write_tiny_llama", full)
    note = ensure_demo_model()
    assert note.startswith(f"Demo model: could not write it to {mirror_root / 'tiny-demo'}")
    assert note.endswith("No space left on device); llmgw runs without it.")


def test_an_operators_tiny_demo_directory_is_left_exactly_as_it_is(mirror_root, demo_on):
    theirs = put(mirror_root, "tiny-demo", "mine", {"model.gguf": b"GGUF theirs"})
    before = os.stat(theirs / "model.gguf").st_mtime_ns
    assert ensure_demo_model() == f"Demo model: {mirror_root / 'tiny-demo'} was there already, so it is left as it is."
    assert listing(mirror_root / "tiny-demo") == ["mine"]
    assert listing(theirs) == ["model.gguf"]
    assert (theirs / "model.gguf").read_bytes() == b"GGUF theirs"
    assert os.stat(theirs / "model.gguf").st_mtime_ns == before


def test_an_empty_tiny_demo_directory_is_left_alone_too(mirror_root, demo_on):
    (mirror_root / "tiny-demo").mkdir()
    ensure_demo_model()
    assert listing(mirror_root / "tiny-demo") == []


def test_with_the_demo_model_turned_off_nothing_is_written(mirror_root, settings):
    settings.DEMO_MODEL = False
    assert ensure_demo_model() is None
    assert listing(mirror_root) == []
    assert not MirrorVersion.objects.exists()


@pytest.mark.parametrize("value, expected", [("", "True"), ("false", "False"), ("0", "False"), ("yes", "True")])
def test_llmgw_demo_model_is_read_from_the_environment(tmp_path, value, expected):
    env = dict(os.environ, LLMGW_VAR=str(tmp_path), LLMGW_DEMO_MODEL=value)
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import django; django.setup(); from django.conf import settings; print(settings.DEMO_MODEL)",
        ],
        cwd=BASE_DIR,
        env=dict(env, DJANGO_SETTINGS_MODULE="llmgw_site.settings"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stdout.strip() == expected, done.stderr
