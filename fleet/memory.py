"""What replicas really hold, as their agents measure it, and what placement makes of it.

Each heartbeat carries, per replica, its engine's resident memory (RSS and PSS of its
process tree) and GPU memory, and the node's available memory (agent/memory.py). The
latest of each node is kept in Redis, like what it runs (fleet.reports), for the
replicas page and the reconcile pass; the highest figure a model's profile has reached
is kept in the database (`MeasuredMemory`), written only when it rises, so placement
still knows it when the model is woken from zero.

Placement books a replica at the larger of its profile's min memory and the measured
figure (docs/placement.md#measured-memory), and a profile that asks for less than its
replicas use gets a warning with the number to raise it to.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass

from django.conf import settings
from django.utils import timezone

from catalog.memory import GB, Estimate, estimate
from catalog.models import Profile
from mirror.models import MirrorVersion

from .live import redis_client
from .models import MeasuredMemory, Replica

MEMORY_PREFIX = "llmgw:node-memory:"


@dataclass(frozen=True)
class Measured:
    """One replica's engine as its node last measured it, in bytes."""

    rss: int
    pss: int | None = None
    gpu: int = 0
    at: float = 0.0
    # The node that measured it: a node speaks only for its own replicas.
    node: str = ""

    @property
    def host(self) -> int:
        """The host memory it holds: PSS where known (mapped weights shared with another replica count once), else RSS."""
        return self.pss if self.pss is not None else self.rss

    @property
    def host_gb(self) -> int:
        """Whole GB, rounded up, as placement books memory."""
        return math.ceil(self.host / GB) if self.host else 0


def _int(value) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return max(0, int(value))


def parse(facts: dict) -> tuple[dict[int, Measured], int | None]:
    """A heartbeat's memory facts as {replica id: Measured} and the node's available bytes; bad entries dropped."""
    now = time.time()
    measured: dict[int, Measured] = {}
    raw = facts.get("replica_memory")
    if isinstance(raw, dict):
        for key, entry in raw.items():
            if not (isinstance(key, str | int) and str(key).isdigit() and isinstance(entry, dict)):
                continue
            rss = _int(entry.get("rss"))
            if rss is None:
                continue
            measured[int(key)] = Measured(rss=rss, pss=_int(entry.get("pss")), gpu=_int(entry.get("gpu")) or 0, at=now)
    return measured, _int(facts.get("memory_available_bytes"))


def record(node_name: str, facts: dict) -> None:
    """Keep a heartbeat's measurements: the node's latest in Redis, and each profile's highest in the database."""
    measured, available = parse(facts)
    if not measured and available is None:
        return
    value = {
        "at": time.time(),
        "available": available,
        "replicas": {str(i): {"rss": m.rss, "pss": m.pss, "gpu": m.gpu} for i, m in measured.items()},
    }
    redis_client().set(
        MEMORY_PREFIX + node_name, json.dumps(value), ex=settings.HEARTBEAT_S * settings.HEARTBEATS_MISSED
    )
    if measured:
        _raise_peaks(node_name, measured)


# Per node, the highest figure each of its replicas was last seen at: a heartbeat whose
# replicas hold no more than before costs one Redis read, not two queries.
SEEN_PREFIX = "llmgw:memory-seen:"
SEEN_KEEP_S = 24 * 3600


def _raise_peaks(node_name: str, measured: dict[int, Measured]) -> None:
    """Each profile's highest figure, raised where this heartbeat's is higher (a write only then)."""
    client = redis_client()
    ids = sorted(measured)
    seen = dict(zip(ids, client.hmget(SEEN_PREFIX + node_name, [str(i) for i in ids]), strict=True))
    risen = {}
    for replica_id, m in measured.items():
        before = seen.get(replica_id)
        try:
            host, gpu = (int(x) for x in before.split()) if before else (-1, -1)
        except (ValueError, AttributeError):
            host, gpu = -1, -1
        if m.host > host or m.gpu > gpu:
            risen[replica_id] = m
    if not risen:
        return
    _write_peaks(node_name, risen)
    key = SEEN_PREFIX + node_name
    client.hset(key, mapping={str(i): f"{m.host} {m.gpu}" for i, m in risen.items()})
    client.expire(key, SEEN_KEEP_S)


def _write_peaks(node_name: str, measured: dict[int, Measured]) -> None:
    replicas = Replica.objects.filter(pk__in=list(measured), node__name=node_name).values_list(
        "pk", "model_name", "profile_name", "source", "engine", "args"
    )
    peaks = {
        (p.model_name, p.profile_name): p
        for p in MeasuredMemory.objects.filter(model_name__in={r[1] for r in replicas})
    }
    for replica_id, model, profile, source, engine, args in replicas:
        m = measured[replica_id]
        peak = peaks.get((model, profile))
        runs_as = {"source": source, "engine": engine, "args": list(args or [])}
        if peak is not None and peak.runs_as() == runs_as and peak.host_bytes >= m.host and peak.gpu_bytes >= m.gpu:
            continue
        if peak is None:
            peak = MeasuredMemory(model_name=model, profile_name=profile)
        elif peak.runs_as() != runs_as:
            # Another version or other arguments: what the old engine used says nothing of this one.
            peak.host_bytes = peak.gpu_bytes = 0
        peak.source, peak.engine, peak.args = source, engine, runs_as["args"]
        if m.host >= peak.host_bytes:
            peak.host_bytes, peak.rss_bytes, peak.replica_id, peak.node_name = m.host, m.rss, replica_id, node_name
        peak.gpu_bytes = max(peak.gpu_bytes, m.gpu)
        peak.measured_at = timezone.now()
        peak.save()
        peaks[(model, profile)] = peak


def latest(node_names: Iterable[str]) -> tuple[dict[int, Measured], dict[str, int]]:
    """({replica id: Measured}, {node: available bytes}) from the nodes' latest heartbeats."""
    names = sorted(set(node_names))
    replicas: dict[int, Measured] = {}
    available: dict[str, int] = {}
    if not names:
        return replicas, available
    for name, raw in zip(names, redis_client().mget([MEMORY_PREFIX + n for n in names]), strict=True):
        if not raw:
            continue
        try:
            value = json.loads(raw)
            for key, entry in value.get("replicas", {}).items():
                replicas[int(key)] = Measured(
                    rss=int(entry["rss"]),
                    pss=entry.get("pss"),
                    gpu=int(entry.get("gpu") or 0),
                    at=value["at"],
                    node=name,
                )
            if value.get("available") is not None:
                available[name] = int(value["available"])
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    return replicas, available


def peaks() -> dict[tuple[str, str], MeasuredMemory]:
    """{(model, profile): its highest measured figure}: what placement asks of a profile once it has one."""
    return {(p.model_name, p.profile_name): p for p in MeasuredMemory.objects.all()}


def measured_gb_for(peak: MeasuredMemory | None, source: str, engine: str, args: Iterable[str]) -> int:
    """The measured figure placement asks for a profile now running as (source, engine, args); 0 when none."""
    if peak is None or peak.runs_as() != {"source": source, "engine": engine, "args": list(args)}:
        return 0
    return peak.host_gb


# --- the estimate, for the pages that show it beside what was measured --------------


def version_of(source: str) -> tuple[str, str] | None:
    """(model, version) of a source on this mirror's byte listener; None for any other address."""
    base = settings.BYTES_URL
    if not source.startswith(base):
        return None
    parts = source[len(base) :].split("/")
    return (parts[0], parts[1]) if len(parts) >= 2 and parts[0] and parts[1] else None


def headers_for(sources: Iterable[str]) -> dict[str, dict]:
    """{source: its version's headers} for the sources that are versions of this mirror, in one query."""
    wanted = {source: key for source in set(sources) if (key := version_of(source))}
    if not wanted:
        return {}
    models = {key[0] for key in wanted.values()}
    rows = MirrorVersion.objects.filter(model__in=models).values_list("model", "version", "headers")
    by_key = {(model, version): headers or {} for model, version, headers in rows}
    return {source: by_key[key] for source, key in wanted.items() if key in by_key}


def estimate_for(headers: dict | None, engine: str, args: Iterable[str], parallel: int = 1) -> Estimate | None:
    return estimate(headers or {}, engine, list(args), parallel=parallel)


def under_asking() -> list[tuple[MeasuredMemory, int]]:
    """(measured figure, the profile's min memory) for every profile whose replicas use more than it asks for.

    Only figures measured of what the profile runs now (same weights, engine, arguments).
    """
    # What each profile runs as now: its args with the engine's slots (Profile.engine_args), as placed.
    profiles = {
        (p.model.name, p.name): (p.min_memory_gb, p.model.source, p.engine, p.engine_args())
        for p in Profile.objects.select_related("model")
    }
    out = []
    for peak in MeasuredMemory.objects.order_by("model_name", "profile_name"):
        profile = profiles.get((peak.model_name, peak.profile_name))
        if profile is None:
            continue
        gb, source, engine, args = profile
        if measured_gb_for(peak, source, engine, args) > gb:
            out.append((peak, gb))
    return out


def asked_gb(peak: MeasuredMemory) -> int | None:
    """What the profile measured asks for now; None when the profile is gone."""
    return (
        Profile.objects.filter(model__name=peak.model_name, name=peak.profile_name)
        .values_list("min_memory_gb", flat=True)
        .first()
    )


def warning(peak: MeasuredMemory, asked_gb: int) -> str:
    """The sentence staff see for a profile that asks for less than its replicas use."""
    return (
        f"Profile {peak.profile_name} of {peak.model_name} asks for {asked_gb} GB, and its replicas use "
        f"{peak.host_bytes / GB:.1f} GB (measured on {peak.node_name or 'a node'}, replica #{peak.replica_id}): "
        f"raise its min memory to {peak.host_gb} GB. Placement already books {peak.host_gb} GB for it."
    )
