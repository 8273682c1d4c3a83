"""What a version's weights say about themselves: the headers of its GGUF and safetensors files.

Read when a scan finds a version new or changed, and kept on the version
(`MirrorVersion.headers`), because the memory a model needs follows from its shape
(layers, KV heads, head size) and its tensors' bytes, not from the size of its files.
Only headers are read: a GGUF's metadata and tensor table, a safetensors file's JSON
header (its first bytes), and `config.json` where there is one.

The weights are untrusted (the mirror is filled by hand), so they are read in a process
of their own (`mirror/header_reader.py`) with limits on its memory, its CPU time per
version and the wall-clock time per version, keeping only the keys the estimate and the
pages use (issue 34). A file that breaks a bound, or kills the reader, leaves the
version indexed as before with `error` saying why, once: it is read again only when a
scan finds the file changed. A version is read once its files have settled (the
readiness rule: unchanged for `LLMGW_MIRROR_SETTLE_S`), never while a copy is under way.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import resource
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

from django.db import DatabaseError, transaction
from django.db.models import F, Q
from django.utils import timezone

from . import disk, header_reader, readiness
from .models import MirrorVersion

log = logging.getLogger(__name__)

# The reader's limits. Memory (its address space): a header reader keeps a few hundred
# numbers, and a safetensors header of the 16 MiB it reads at most parses in well under
# this. CPU per version: a 256,000-token GGUF header is walked in under a second here.
# Wall clock per version: the CPU limit plus time for a slow disk.
READER_MEMORY_BYTES = 512 << 20
READER_CPU_S = 30
READER_TIMEOUT_S = 90
# Versions per reader process. One process per batch, not per version: starting Python
# costs ~30 ms, a thousand versions copied in at once would cost half a minute of starts.
# A version that kills its reader costs only a new process for the ones after it.
READER_BATCH = 200
# A result line longer than this is not one the reader writes.
MAX_RESULT_BYTES = 4 << 20
READER_PATH = Path(header_reader.__file__)

# What a version's `headers` may hold once read, and of what type: nothing else is stored.
TEXT_KEYS = ("format", "architecture", "dtype", "error")
NUMBER_KEYS = tuple(header_reader.FIELD_LIMITS)
MAX_SENTENCE = 1000


@functools.cache
def _gguf_types() -> dict | None:
    """{ggml type: [name, elements per block, bytes per block]} from the gguf package, None where it is not installed."""
    try:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    except ImportError:
        return None
    return {
        str(int(kind)): [kind.name, *GGML_QUANT_SIZES[kind]]
        for kind in GGMLQuantizationType
        if kind in GGML_QUANT_SIZES
    }


def _format_of(names) -> str:
    lower = [name.lower() for name in names]
    if any(name.endswith(".gguf") for name in lower):
        return "gguf"
    return "safetensors" if any(name.endswith(".safetensors") for name in lower) else ""


def _sentence(text: str) -> str:
    """A sentence as it may be stored and shown: no control characters (PostgreSQL refuses a NUL), bounded."""
    clean = "".join(ch if ch >= " " and ch != "\x7f" else "?" for ch in str(text))
    clean = clean.encode("utf-8", "replace").decode("utf-8")  # and no lone surrogate, which it refuses too
    return clean if len(clean) <= MAX_SENTENCE else clean[: MAX_SENTENCE - 1] + "…"


def stored(summary, names) -> dict:
    """The summary a reader gave, as it is stored: only the kept keys, each of its type and within its bound.

    Anything else is a reader that was not this one (or a bug in it), and becomes a sentence:
    whatever the version's files hold, the row's JSON is one PostgreSQL takes.
    """
    files = sorted(names)
    fmt = _format_of(files)
    if not isinstance(summary, dict):
        return {"format": fmt, "error": "the header reader gave no summary for it"}
    out: dict = {}
    for key in TEXT_KEYS:
        value = summary.get(key)
        if value is None:
            continue
        if key == "error":
            out[key] = _sentence(value)
        elif problem := header_reader.name_problem(value, key):
            return {"format": fmt, "error": _sentence(f"the header reader gave {problem}")}
        else:
            out[key] = value
    for key in NUMBER_KEYS:
        value = summary.get(key)
        if value is None:
            continue
        if problem := header_reader.number_problem(value, key, header_reader.FIELD_LIMITS[key]):
            return {"format": fmt, "error": _sentence(f"the header says {problem}")}
        out[key] = value
    types = summary.get("tensor_types")
    if types is not None:
        known = header_reader.SAFETENSORS_DTYPES | {name for name, _, _ in (_gguf_types() or {}).values()}
        if not isinstance(types, dict) or not all(
            k in known and not header_reader.number_problem(v, k, header_reader.FIELD_LIMITS["weights_bytes"])
            for k, v in types.items()
        ):
            return {"format": fmt, "error": "the header reader gave tensor types that are not ones"}
        out["tensor_types"] = types
    listed = summary.get("files")
    if isinstance(listed, list) and all(name in files for name in listed):
        out["files"] = listed
    out.setdefault("format", fmt)
    return out


# --- the reader process --------------------------------------------------------------


def read_many(jobs: list[dict]) -> dict[int, dict]:
    """{job id: summary} for jobs of {"id", "files": [[name, path, bytes, mtime_ns], ...]}, in bounded processes.

    A job whose reading kills its process (memory, CPU, time) gets the sentence saying
    so, and the jobs after it a new process.
    """
    types = _gguf_types()
    results: dict[int, dict] = {}
    remaining = list(jobs)
    while remaining:
        batch = remaining[:READER_BATCH]
        _run_reader(batch, types, results)
        remaining = [job for job in remaining if job["id"] not in results]
    return results


def _run_reader(jobs: list[dict], types: dict | None, results: dict[int, dict]) -> None:
    """Read `jobs` in one reader process, in order, until it ends; the job it died on gets the reason."""
    order = {"types": types, "cpu_s": READER_CPU_S, "jobs": jobs}
    with tempfile.TemporaryFile() as stderr:
        # -I -S: the standard library only, nothing from the environment or site-packages.
        reader = subprocess.Popen(
            [sys.executable, "-I", "-S", str(READER_PATH)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            close_fds=True,
        )
        try:
            # Limited before it is given any work (its start is ours, its input is not): with
            # prlimit rather than a preexec_fn, which is not safe in a worker with threads.
            resource.prlimit(reader.pid, resource.RLIMIT_AS, (READER_MEMORY_BYTES, READER_MEMORY_BYTES))
            cpu = READER_CPU_S * len(jobs) + 10
            resource.prlimit(reader.pid, resource.RLIMIT_CPU, (cpu, cpu))
            try:
                reader.stdin.write(json.dumps(order).encode())
                reader.stdin.close()
            except BrokenPipeError:
                pass
            lines = _Lines(reader.stdout.fileno())
            for job in jobs:
                line = lines.next(time.monotonic() + READER_TIMEOUT_S)
                if line is None or line is _Lines.TOO_LONG:
                    results[job["id"]] = _died(reader, job, lines.timed_out, stderr)
                    return
                try:
                    answer = json.loads(line)
                    summary = answer["summary"] if answer.get("id") == job["id"] else None
                except (ValueError, AttributeError, TypeError, KeyError):
                    summary = None
                results[job["id"]] = stored(summary, [f[0] for f in job["files"]])
        finally:
            if reader.poll() is None:
                try:
                    reader.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    reader.kill()
                    reader.wait()
            reader.stdout.close()


def _died(reader: subprocess.Popen, job: dict, timed_out: bool, stderr) -> dict:
    """The sentence for the version a reader stopped on: which limit, in words."""
    names = [f[0] for f in job["files"]]
    if timed_out:
        reader.kill()
        reader.wait()
        why = f"reading its headers took longer than {READER_TIMEOUT_S} s, and was stopped"
    else:
        try:
            code = reader.wait(timeout=10)
        except subprocess.TimeoutExpired:
            reader.kill()
            code = reader.wait()
        stderr.seek(0)
        said = stderr.read()[-4000:].decode("utf-8", "replace")
        if code == -signal.SIGXCPU:
            why = f"reading its headers took more than {READER_CPU_S} s of CPU, and was stopped"
        elif "MemoryError" in said or code == -signal.SIGKILL:
            why = f"reading its headers needed more than the header reader's {READER_MEMORY_BYTES >> 20} MiB"
        else:
            why = f"the header reader stopped while reading them (exit status {code})"
        log.warning("mirror headers: the reader stopped on version %s (exit %s): %s", job["id"], code, said[-800:])
    return {"format": _format_of(names), "files": sorted(names), "error": _sentence(why)}


class _Lines:
    """Lines from the reader's stdout, each waited for until a deadline."""

    TOO_LONG = object()

    def __init__(self, fd: int):
        self.fd, self.buffer, self.timed_out = fd, b"", False

    def next(self, deadline: float):
        while b"\n" not in self.buffer:
            if len(self.buffer) > MAX_RESULT_BYTES:
                return self.TOO_LONG
            left = deadline - time.monotonic()
            if left <= 0:
                self.timed_out = True
                return None
            ready, _, _ = select.select([self.fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                return None
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line


def read_version(paths: Mapping[str, Path]) -> dict:
    """The headers of one version's files (name -> path), merged into one summary, read as a scan reads them."""
    files = []
    for name, path in sorted(paths.items()):
        try:
            st = os.stat(path)
        except OSError as error:
            return {"format": _format_of(paths), "error": _sentence(f"{name} cannot be read: {error.strerror}")}
        files.append([name, str(path), st.st_size, st.st_mtime_ns])
    return read_many([{"id": 0, "files": files}])[0]


# --- a scan's versions ---------------------------------------------------------------


def stale_versions():
    """Versions whose headers were never read, or were read before a scan last found them changed."""
    return MirrorVersion.objects.filter(Q(headers_read__isnull=True) | Q(headers_read__lt=F("scanned_at")))


# Whether this process has looked for versions whose headers were never read (indexed
# before headers were, or read by a worker that died): once per process, so a scan of an
# unchanged mirror stays the one query it is (docs/mirror.md).
_looked_for_unread = False
# Versions this process found still being copied in: looked at again at its next scan,
# which reads them once they have settled.
_unsettled: set[int] = set()


def read_changed(report) -> int:
    """Read the headers of every version the scan added or changed, once settled; how many were read.

    Called by the scan after it has written the index: nothing to do, and no query, when
    it found nothing new and nothing is waiting to settle (after the first scan of a
    process, which also reads what was never read).
    """
    global _looked_for_unread, _unsettled
    if not (report.added or report.changed or _unsettled) and _looked_for_unread:
        return 0
    _looked_for_unread = True
    # Before the reads: a file changed while it is read makes a later scan's scanned_at newer, and it is read again.
    now = timezone.now()
    jobs, waiting = [], set()
    for version in stale_versions().prefetch_related("files"):
        on_disk = disk.version_files(version.model, version.version)
        if on_disk is None:
            continue  # gone since the walk: the next scan removes it
        if readiness.being_written(on_disk) is not None:
            waiting.add(version.pk)
            continue
        listed = {f.name: f for f in on_disk}
        files = []
        for row in version.files.all():
            # Through disk.resolve, as the byte listener serves them: a link out of the root is not followed.
            path = disk.resolve(version.model, version.version, row.name)
            found = listed.get(row.name)
            if path is not None and found is not None:
                files.append([row.name, str(path), found.bytes, found.mtime_ns])
        jobs.append({"id": version.pk, "files": files, "name": str(version)})
    _unsettled = waiting
    if not jobs:
        return 0
    summaries = read_many(jobs)
    rows = []
    for job in jobs:
        summary = summaries[job["id"]]
        if summary.get("error"):
            log.warning("mirror scan: %s: %s", job["name"], summary["error"])
        rows.append(MirrorVersion(pk=job["id"], headers=summary, headers_read=now))
    _save(rows)
    return len(rows)


def _save(rows: list[MirrorVersion]) -> None:
    """In one statement per batch, like the scan's own writes; row by row if the database refuses the batch.

    Every summary went through `stored`, so a refusal is not expected: but one version's
    headers must never keep another's from being written, so each row is then tried alone.
    """
    try:
        with transaction.atomic():
            MirrorVersion.objects.bulk_update(rows, ["headers", "headers_read"], batch_size=500)
        return
    except DatabaseError:
        log.exception("mirror scan: the headers of %d versions could not be written together", len(rows))
    for row in rows:
        try:
            with transaction.atomic():
                MirrorVersion.objects.filter(pk=row.pk).update(headers=row.headers, headers_read=row.headers_read)
        except DatabaseError as error:
            fallback = {
                "format": row.headers.get("format", ""),
                "error": _sentence(f"the headers could not be stored ({type(error).__name__})"),
            }
            MirrorVersion.objects.filter(pk=row.pk).update(headers=fallback, headers_read=row.headers_read)
