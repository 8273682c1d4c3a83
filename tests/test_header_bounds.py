"""Weights' headers are untrusted input (issue 34, items 1 and 2): each crafted file here is read by
the real scan, in the real bounded reader process, on the tests' PostgreSQL.

A file that breaks a bound is indexed with a sentence saying which, once; a good version read in
the same pass after it still gets its headers; the serve plan, the serve page and the replicas page
answer with a sentence; and reconcile still sends the other model's start.
"""

from __future__ import annotations

import base64
import json
import math
import os
import signal
import struct
from pathlib import Path

import pytest
from django.conf import settings
from django.utils import timezone
from rest_framework.test import APIClient

from catalog.memory import checked, estimate
from fleet import reconcile
from fleet.enrolment import issue_token
from fleet.models import Node
from fleet.placement import ModelView, ProfileView
from mirror import headers, scan
from mirror.models import MirrorVersion
from mirror.tasks import scan_task

from .support.mirror import settle
from .support.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

MiB = 1 << 20

# --- a GGUF written byte by byte, as an attacker would --------------------------------

U32, F32, STRING, ARRAY = 4, 6, 8, 9


def _str(raw: bytes) -> bytes:
    return struct.pack("<Q", len(raw)) + raw


def kv(key: str, kind: int, payload: bytes) -> bytes:
    return _str(key.encode()) + struct.pack("<I", kind) + payload


def u32(key: str, value: int) -> bytes:
    return kv(key, U32, struct.pack("<I", value))


def text(key: str, value: bytes) -> bytes:
    return kv(key, STRING, _str(value))


def shape(arch: bytes = b"llama", **override: bytes) -> list[bytes]:
    """A small llama's keys; `override` replaces one by its suffix (block_count=...)."""
    fields = {
        "block_count": u32("llama.block_count", 2),
        "head_count": u32("llama.attention.head_count", 4),
        "head_count_kv": u32("llama.attention.head_count_kv", 2),
        "embedding_length": u32("llama.embedding_length", 64),
        "context_length": u32("llama.context_length", 256),
    }
    fields.update(override)
    return [text("general.architecture", arch), *fields.values()]


def write_gguf(path: Path, keys: list[bytes], tensor_count: int = 1, hole: int = 0) -> Path:
    """A GGUF of these keys and one F32 tensor of 16 elements (its 64 bytes there), or a claimed tensor count.

    `hole`: zero bytes after the last key, as a hole in the file (the rest of the last key's value).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(b"GGUF" + struct.pack("<IQQ", 3, tensor_count, len(keys)) + b"".join(keys))
        f.seek(hole, os.SEEK_CUR)
        f.write(_str(b"t") + struct.pack("<IQIQ", 1, 16, 0, 0))
        f.write(b"\0" * (-f.tell() % 32) + b"\0" * 64)
    return path


def write_sparse_gguf(path: Path, strings: int, each: int) -> Path:
    """A GGUF whose unused keys are `strings` strings of `each` bytes, written as holes: a large file on no disk."""
    path.parent.mkdir(parents=True, exist_ok=True)
    keys = shape()
    with open(path, "wb") as f:
        f.write(b"GGUF" + struct.pack("<IQQ", 3, 1, len(keys) + strings))
        for n in range(strings):
            f.write(_str(f"junk.{n}".encode()) + struct.pack("<IQ", STRING, each))
            f.seek(each, os.SEEK_CUR)
        f.write(b"".join(keys) + _str(b"t") + struct.pack("<IQIQ", 1, 16, 0, 0))
        f.write(b"\0" * (-f.tell() % 32) + b"\0" * 64)
    return path


def write_many_dtypes(path: Path, tensors: int) -> Path:
    """A safetensors file whose every tensor has a dtype of its own: a table of `tensors` dtypes."""
    header = {f"t{n}": {"dtype": f"X{n}", "shape": [1], "data_offsets": [0, 0]} for n in range(tensors)}
    raw = json.dumps(header).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    return path


@pytest.fixture
def good(mirror_root):
    """A version named to be read after every crafted one (the scan reads them in order), with an Inf in a key not kept."""
    inf = kv("llama.rope.freq_base", F32, struct.pack("<f", math.inf))
    return write_gguf(mirror_root / "zz-good" / "v1" / "model.gguf", [*shape(), inf])


def crafted(mirror_root: Path) -> dict[str, str]:
    """Every crafted file of the issue, each a version: {model: the words its sentence must hold}."""
    many = shape() + [u32(f"junk.{n}", n) for n in range(70_000)]
    write_gguf(mirror_root / "many-keys" / "v1" / "model.gguf", many)
    nested = kv(
        "junk.nested", ARRAY, struct.pack("<IQ", ARRAY, 1) + struct.pack("<IQ", ARRAY, 1) + struct.pack("<IQ", 0, 0)
    )
    write_gguf(mirror_root / "nested" / "v1" / "model.gguf", [*shape(), nested])
    # Nine million arrays of no bytes claimed, twelve zero bytes each: a hole the old reader walked one by one.
    wide = kv("junk.wide", ARRAY, struct.pack("<IQ", ARRAY, 9_000_000))
    write_gguf(mirror_root / "wide" / "v1" / "model.gguf", [*shape(), wide], hole=12 * 9_000_000)
    write_gguf(mirror_root / "tensors" / "v1" / "model.gguf", shape(), tensor_count=10_000_000)
    write_gguf(
        mirror_root / "nan" / "v1" / "model.gguf",
        shape(context_length=kv("llama.context_length", F32, struct.pack("<f", math.nan))),
    )
    write_gguf(mirror_root / "nul" / "v1" / "model.gguf", shape(arch=b"llama\0"))
    write_gguf(
        mirror_root / "stringy" / "v1" / "model.gguf",
        shape(
            block_count=text("llama.block_count", b"3"),
            head_count_kv=u32("llama.attention.head_count_kv", 1000),
        ),
    )
    write_many_dtypes(mirror_root / "dtypes" / "v1" / "model.safetensors", 50_000)
    return {
        "many-keys": f"claims {len(many):,} keys; llmgw reads at most 65,536",
        "nested": "arrays nested more than 2 deep",
        "wide": "an array of 9,000,000 values",
        "tensors": "claims 10,000,000 tensors; llmgw reads at most 200,000",
        "nan": "llama.context_length is a float32, not a whole number",
        "nul": "general.architecture holds a control character",
        "stringy": "llama.block_count is a string, not a whole number",
        "dtypes": "the dtype 'X0', which is not one",
    }


# --- the scan --------------------------------------------------------------------------


def test_each_crafted_header_is_indexed_with_its_sentence_once_and_the_good_version_after_them_gets_its_headers(
    mirror_root, good
):
    sentences = crafted(mirror_root)
    write_sparse_gguf(mirror_root / "sparse" / "v1" / "model.gguf", strings=6, each=64 * MiB)
    settle(mirror_root)
    report = scan.scan_mirror()
    assert len(report.added) == len(sentences) + 2

    for model, words in sentences.items():
        version = MirrorVersion.objects.get(model=model)
        assert version.headers_read is not None, model
        assert words in version.headers.get("error", ""), (model, version.headers)
        assert "\0" not in json.dumps(version.headers)
        # What is stored is the summary's few keys, never the file's tables.
        assert len(json.dumps(version.headers)) < 2000, model
    # Strings of 64 MiB in keys nobody uses are skipped by their length, and the shape is read.
    sparse = MirrorVersion.objects.get(model="sparse").headers
    assert "error" not in sparse and (sparse["layers"], sparse["kv_heads"]) == (2, 2)
    assert max(len(str(v)) for v in sparse.values()) < 200
    # The good version, read after all of them in the same pass, has its headers (an Inf it does not use skipped).
    kept = MirrorVersion.objects.get(model="zz-good").headers
    assert "error" not in kept and (kept["layers"], kept["heads"], kept["trained_context"]) == (2, 4, 256)

    # Once: a scan of the unchanged mirror reads none of them again.
    read_at = dict(MirrorVersion.objects.values_list("model", "headers_read"))
    assert headers.read_changed(scan.scan_mirror()) == 0
    assert dict(MirrorVersion.objects.values_list("model", "headers_read")) == read_at
    # A process that starts afresh looks for headers never read, and finds none to read again.
    headers._looked_for_unread = False
    scan.scan_mirror()
    assert dict(MirrorVersion.objects.values_list("model", "headers_read")) == read_at


def test_a_file_still_being_copied_in_is_read_only_once_it_has_settled(mirror_root):
    path = write_gguf(mirror_root / "fresh" / "v1" / "model.gguf", shape())
    scan.scan_mirror()
    version = MirrorVersion.objects.get(model="fresh")
    assert version.headers_read is None  # modified just now: a copy may be under way
    settle(path)  # ... and it stops changing (the scan finds it changed once more: its mtime moved)
    scan.scan_mirror()
    version.refresh_from_db()
    assert version.headers_read is not None and version.headers["layers"] == 2


def test_a_reader_past_its_memory_limit_is_stopped_and_the_version_says_so(mirror_root, good, monkeypatch):
    # A safetensors header within the size read (16 MiB), whose parse needs more than the limit given here.
    header = {f"t{n}": {"dtype": "F16", "shape": [1], "data_offsets": [0, 0]} for n in range(150_000)}
    raw = json.dumps(header).encode()
    path = mirror_root / "hungry" / "v1" / "model.safetensors"
    path.parent.mkdir(parents=True)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    settle(mirror_root)
    monkeypatch.setattr(headers, "READER_MEMORY_BYTES", 64 * MiB)
    scan.scan_mirror()
    hungry = MirrorVersion.objects.get(model="hungry")
    assert (
        "more memory than the header reader may use" in hungry.headers["error"] or "64 MiB" in hungry.headers["error"]
    )
    assert "error" not in MirrorVersion.objects.get(model="zz-good").headers


def test_the_estimate_takes_only_checked_numbers():
    base = {"format": "gguf", "weights_bytes": 10 * MiB, "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 16}
    assert estimate(base, "llamacpp", ["--ctx-size", "256"]).kv_cache == 2 * 2 * 32 * 2 * 256
    for bad in ({"layers": "3", "kv_heads": 10**6}, {"layers": math.nan}, {"kv_heads": math.inf}, {"layers": True}):
        header = {**base, **bad}
        assert estimate(header, "llamacpp", ["--ctx-size", "256"]) is None
        assert estimate(header, "vllm", []) is None
        assert "not a whole number" in checked(header)
    assert "outside 0 to" in checked({**base, "layers": 10**9})
    # Arguments that are not finite numbers are not taken for any either.
    assert estimate(base, "llamacpp", ["--ctx-size", "inf", "--cache-ram", "nan"]) is not None


# --- the pages and the start order -----------------------------------------------------


@pytest.fixture
def node_token(broker):
    token = issue_token("a")
    Node.objects.filter(name="a").update(last_heartbeat=timezone.now(), engines=["llamacpp"], memory_gb=64)
    return token


def test_a_header_that_is_not_numbers_gives_the_pages_a_sentence_and_stops_no_start(
    mirror_root, good, admin_client, admin_user, broker, node_token
):
    write_gguf(
        mirror_root / "stringy" / "v1" / "model.gguf",
        shape(block_count=text("llama.block_count", b"3"), head_count_kv=u32("llama.attention.head_count_kv", 1000)),
    )
    settle(mirror_root)
    scan.scan_mirror()

    api = APIClient()
    api.force_authenticate(admin_user)
    plan = api.get("/api/serve/plan/?model=stringy&version=v1")
    assert plan.status_code == 200, plan.content[:2000]
    memory = plan.json()["memory"]
    assert memory["source"] == "size" and "llama.block_count is a string" in memory["reason"]
    page = admin_client.get("/serve/stringy/v1/")
    assert page.status_code == 200 and "llama.block_count is a string" in page.content.decode()
    assert "llama.block_count is a string" in MirrorVersion.objects.get(model="stringy").headers["error"]

    # Reconcile: the bad version's model first, the good one after; both starts are sent.
    base = settings.BYTES_URL
    models = [
        ModelView("aa-bad", f"{base}stringy/v1/model.gguf", 1, (ProfileView("cpu", "llamacpp", min_memory_gb=1),)),
        ModelView("zz-good", f"{base}zz-good/v1/model.gguf", 1, (ProfileView("cpu", "llamacpp", min_memory_gb=1),)),
    ]
    reconcile.reconcile(models=models)
    sent = []
    while (raw := broker.rpop("node.a")) is not None:
        message = json.loads(raw)
        sent.append(json.loads(base64.b64decode(message["body"]))[0])
    by_source = {args[1]: args[3] for args in sent}
    assert set(by_source) == {models[0].source, models[1].source}
    # The bad header gives no estimate, so no prompt cache; the good one's is bounded to its KV cache.
    assert by_source[models[0].source] == ["--cache-ram", "0"]
    assert by_source[models[1].source][0] == "--cache-ram" and by_source[models[1].source][1] != "0"

    replicas = admin_client.get("/admin/fleet/replica/")
    assert replicas.status_code == 200
    assert "llama.block_count is a string" in replicas.content.decode()


# --- the control worker ----------------------------------------------------------------


def _worker_processes(worker) -> list[int]:
    """The Celery worker's process and its pool's processes."""
    main = worker.popen.pid
    found = [main]
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == main:
                found.append(int(entry))
    return found


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _scan_on_the_worker() -> None:
    scan_task.delay()


def test_the_control_worker_reads_huge_strings_with_its_memory_bounded(mirror_root, good, control_worker):
    wait_until(lambda: len(_worker_processes(control_worker)) >= 3, timeout=30, what="the worker's pool")
    before = {pid: _peak_rss_mb(pid) for pid in _worker_processes(control_worker)}
    # Six strings of 64 MiB in keys nobody uses: the old reader decoded each into the worker's memory.
    write_sparse_gguf(mirror_root / "sparse" / "v1" / "model.gguf", strings=6, each=64 * MiB)
    settle(mirror_root)
    _scan_on_the_worker()
    wait_until(
        lambda: MirrorVersion.objects.filter(model="sparse", headers_read__isnull=False).exists()
        and MirrorVersion.objects.filter(model="zz-good", headers_read__isnull=False).exists(),
        timeout=120,
        what=f"the headers read\n{control_worker.output()[-3000:]}",
    )
    assert MirrorVersion.objects.get(model="sparse").headers["layers"] == 2
    grown = {pid: _peak_rss_mb(pid) - mb for pid, mb in before.items() if Path(f"/proc/{pid}").exists()}
    assert max(grown.values()) < 64, grown


def _reader_with(path: Path) -> int | None:
    """The pid of a process that has `path` open: the header reader, mid-read."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            for fd in os.listdir(f"/proc/{entry}/fd"):
                if os.readlink(f"/proc/{entry}/fd/{fd}") == str(path):
                    return int(entry)
        except OSError:
            continue
    return None


def test_a_file_replaced_mid_read_gives_a_sentence_not_a_sigbus(mirror_root, good, control_worker):
    # A vocabulary of three million one-byte tokens: seconds of walking, time to replace the file under it.
    path = mirror_root / "replaced" / "v1" / "model.gguf"
    tokens = kv("tokenizer.ggml.tokens", ARRAY, struct.pack("<IQ", STRING, 3_000_000) + _str(b"x") * 3_000_000)
    write_gguf(path, [*shape(), tokens])
    settle(mirror_root)
    _scan_on_the_worker()
    reader = wait_until(lambda: _reader_with(path), timeout=60, interval=0.005, what="the header reader to open it")
    os.kill(reader, signal.SIGSTOP)
    try:
        # `cp` over it: the same file, cut short and written again, while the reader holds it.
        with open(path, "r+b") as f:
            f.truncate(100)
    finally:
        os.kill(reader, signal.SIGCONT)
    wait_until(
        lambda: MirrorVersion.objects.filter(model="replaced", headers_read__isnull=False).exists()
        and MirrorVersion.objects.filter(model="zz-good", headers_read__isnull=False).exists(),
        timeout=120,
        what=f"the headers read\n{control_worker.output()[-3000:]}",
    )
    error = MirrorVersion.objects.get(model="replaced").headers["error"]
    assert "model.gguf changed while its header was read" in error
    assert "error" not in MirrorVersion.objects.get(model="zz-good").headers
    assert control_worker.alive() and "SIGBUS" not in control_worker.output()
