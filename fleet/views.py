"""The fleet's fetches, live: a page per node, and the progress of one source.

One view serves each page and its fragment, switching on request.htmx, so the
page and its refresh can never show two different things.
"""

from __future__ import annotations

from django.contrib import admin
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_safe

from common.permissions import staff_with
from contracts import progress

from .live import redis_client
from .models import Fetch, Node


def fleet_fetches() -> list[dict]:
    """Per node: its recorded fetches joined with what Redis says is happening now."""
    enrolled = list(Node.objects.values_list("name", flat=True))
    live: dict[tuple[str, str], dict] = {}
    for source, snapshots in progress.read_recent(redis_client(), enrolled):
        for node, snapshot in snapshots.items():
            live[(node, source)] = snapshot
    records = {(f.node.name, f.source): f for f in Fetch.objects.select_related("node")}
    names = sorted({n for n, _ in live} | {n for n, _ in records} | set(enrolled))
    out = []
    for name in names:
        sources = sorted({s for n, s in live if n == name} | {s for n, s in records if n == name})
        rows = [_row(source, live.get((name, source)), records.get((name, source))) for source in sources]
        out.append({"node": name, "fetches": rows})
    return out


def _row(source: str, snapshot: dict | None, record: Fetch | None) -> dict:
    snapshot = snapshot or {}
    total = snapshot.get("bytes_total") or (record.bytes_total if record else 0)
    done = snapshot.get("bytes_done") or 0
    state = snapshot.get("state") or (record.state if record else "")
    if record is not None and record.state in (Fetch.State.REQUESTED,) and not snapshot:
        state = "queued"
    return {
        "source": source,
        "state": state,
        "bytes_done": done,
        "bytes_total": total,
        "percent": progress.percent({"state": state, "bytes_done": done, "bytes_total": total}),
        "files_done": snapshot.get("files_done", 0),
        "files_total": snapshot.get("files_total") or (record.files_total if record else 0),
        "current_file": snapshot.get("current_file", ""),
        "rate": snapshot.get("rate", 0),
        "error": snapshot.get("error") or (record.error if record else ""),
        "record": record,
    }


@require_safe
@staff_with("fleet.view_fetch")
def fetches(request: HttpRequest) -> HttpResponse:
    context = {"nodes": fleet_fetches()}
    if request.htmx:
        return render(request, "fleet/partials/fetches.html", context)
    # The admin's own header, links and theme, as on every other staff page.
    context.update(admin.site.each_context(request), title="Fetches on the fleet")
    return render(request, "fleet/fetches.html", context)


@require_safe
@staff_with("fleet.view_fetch")
def source_progress(request: HttpRequest) -> HttpResponse:
    """One source's progress on every node: the fragment the mirror version page polls."""
    source = request.GET.get("source", "")
    enrolled = Node.objects.values_list("name", flat=True)
    snapshots = progress.read(redis_client(), source, enrolled) if source else {}
    rows = [dict(_row(source, snapshot, None), node=node) for node, snapshot in snapshots.items()]
    return render(request, "fleet/partials/progress.html", {"source": source, "rows": rows})
