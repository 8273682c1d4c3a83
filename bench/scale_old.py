"""The control plane's periodic jobs as they were before issue 17, kept to be measured beside
today's by bench/scale.py (run against the same database and files in the same run)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from harness import ROOT

__all__ = ["old_heartbeat", "old_load_table", "old_replica_report", "old_scan_mirror", "old_tree"]


def _old_skipped_names(directory, where):
    """mirror.scan._skipped_names before issue 17."""
    from contracts.names import plain_name_problem

    sentences = []
    try:
        entries = sorted(os.listdir(directory))
    except OSError:
        return sentences
    for name in entries:
        problem = plain_name_problem(name)
        if problem is None or name.startswith(".") or name.endswith(".part"):
            continue
        sentences.append(f"{where}{name!r} is not indexed: {problem}")
    return sentences


def _old_reconcile_version(model, version, files, now, report):
    """mirror.scan._reconcile_version before issue 17 (atomic: `old_scan_mirror` wraps it)."""
    from mirror.models import MirrorFile, MirrorVersion

    row, created = MirrorVersion.objects.get_or_create(model=model, version=version, defaults={"scanned_at": now})
    if created:
        report.added.append(str(row))
    else:
        row.scanned_at = now
        row.save(update_fields=["scanned_at"])
    indexed = {f.name: f for f in row.files.all()}
    on_disk = {f.name for f in files}
    for gone in set(indexed) - on_disk:
        indexed[gone].delete()
        report.changed.append(f"{row}/{gone} removed")
    for f in files:
        existing = indexed.get(f.name)
        if existing is None:
            new = MirrorFile.objects.create(version=row, name=f.name, bytes=f.bytes, mtime_ns=f.mtime_ns)
            report.to_hash.append(new.pk)
            if not created:
                report.changed.append(f"{row}/{f.name} added")
        elif existing.bytes != f.bytes or existing.mtime_ns != f.mtime_ns:
            existing.bytes, existing.mtime_ns = f.bytes, f.mtime_ns
            existing.sha256, existing.hashed_at = "", None
            existing.save()
            report.to_hash.append(existing.pk)
            report.changed.append(f"{row}/{f.name} changed")
        elif not existing.sha256:
            report.to_hash.append(existing.pk)


def old_scan_mirror():
    """mirror.scan.scan_mirror before issue 17: a query or more per version, a write per version."""
    from django.db import transaction
    from django.utils import timezone

    from mirror import disk
    from mirror.models import MirrorVersion
    from mirror.scan import ScanReport

    report = ScanReport()
    now = timezone.now()
    root = disk.root()
    report.skipped += _old_skipped_names(root, "")
    seen = set()
    for model in disk.model_names():
        report.skipped += _old_skipped_names(root / model, f"{model}/")
        for version in disk.version_names(model):
            report.skipped += _old_skipped_names(root / model / version, f"{model}/{version}/")
            files = disk.version_files(model, version)
            if files is None:
                continue
            seen.add((model, version))
            with transaction.atomic():
                _old_reconcile_version(model, version, files, now, report)
    for row in MirrorVersion.objects.all():
        if (row.model, row.version) not in seen:
            report.removed.append(str(row))
            row.delete()
    return report


def old_load_table():
    """gateway.routes.load before issue 17: every model, profile, ready replica and key, every second."""
    from catalog.models import Model, Profile
    from fleet.models import Replica
    from gateway.models import ApiKey
    from gateway.routes import Key, Route, Table, Upstream

    weights = {(p.model_id, p.name): max(p.weight, 0) for p in Profile.objects.all()}
    ready = {}
    for replica in Replica.objects.filter(state=Replica.State.READY).exclude(endpoint=""):
        ready.setdefault(replica.model_name, []).append(replica)
    table = Table()
    for model in Model.objects.all():
        upstreams = tuple(
            Upstream(r.pk, r.endpoint.rstrip("/"), weights.get((model.pk, r.profile_name), 1))
            for r in ready.get(model.name, [])
        )
        aliases = tuple(a for a in (model.aliases or []) if isinstance(a, str))
        route = Route(
            model.name, aliases, model.context_length, model.max_output, int(model.added_at.timestamp()), upstreams
        )
        table.models.append(route)
        for alias in aliases:
            table.routes.setdefault(alias, route)
        table.routes[model.name] = route
    for key in ApiKey.objects.filter(active=True):
        allowed = frozenset(key.model_names) if key.model_names else None
        table.keys[key.key_hash] = Key(key.pk, key.name, allowed)
    return table


def old_heartbeat(token: str, facts: dict) -> None:
    """fleet.tasks.heartbeat's body before issue 17: every field saved on every beat."""
    from django.utils import timezone

    from fleet.enrolment import node_for_token

    node = node_for_token(token, claimed_name=facts.get("node"))
    if node is None:
        return
    node.engines = [str(e) for e in facts.get("engines") or []]
    node.gpus = list(facts.get("gpus") or [])
    node.memory_gb = max(0, int(facts.get("memory_gb") or 0))
    node.disk_free_bytes = max(0, int(facts.get("disk_free_bytes") or 0))
    node.agent_version = str(facts.get("agent_version") or "")[:50]
    if isinstance(facts.get("labels"), dict):
        node.labels = {str(k): str(v) for k, v in facts["labels"].items()}
    node.last_heartbeat = timezone.now()
    node.save()


def old_replica_report(token: str, replica_id: int, state: str, endpoint: str = "", reason: str = "") -> None:
    """fleet.tasks.replica_report's body before issue 17: a locked read and a full save on every report."""
    from django.db import transaction

    from fleet.enrolment import node_for_token
    from fleet.models import Replica

    node = node_for_token(token)
    if node is None:
        return
    with transaction.atomic():
        replica = Replica.objects.select_for_update().filter(pk=replica_id).first()
        if replica is None or replica.node_id != node.pk or replica.state == Replica.State.STOPPING:
            return
        if state == "ready":
            replica.attempts = 0
        replica.enter(state, reason[:4000], endpoint if state == "ready" else "")
        replica.save()


def old_tree(ref: str, var: Path) -> Path:
    """The code at `ref`, unpacked with git archive (nothing of the repository changes)."""
    where = var / f"old-{ref.replace('/', '_').replace('~', '_')}"
    where.mkdir()
    archive = subprocess.run(["git", "archive", ref], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
    return where
