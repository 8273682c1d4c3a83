"""The fleet on the admin's front page: nodes, memory as placed, replicas, fetches under way.

A few grouped queries whatever the size of the fleet: the page is the first thing
staff see, and it has to answer as fast with a thousand nodes as with one.
"""

from __future__ import annotations

import redis
from django.db.models import Count, Q, Sum

from contracts import progress

from . import engine_stats, memory
from .live import redis_client
from .models import Node, Replica, heartbeat_deadline

# Bars beyond these would make the page a list of a thousand nodes: the fullest are shown.
NODES_SHOWN = 24
LIVE_STATES = ("queued", "fetching", "verifying")
# Progress keys looked at for fetches under way: the newest sources, as the fetch page does.
SOURCES_LOOKED_AT = 200


def _in_use(names: list[str]) -> dict[str, int]:
    """Bytes the engines on each node hold, as the node last measured them: placement books whole GB, so a
    replica under a gigabyte shows here, not in what is placed. Nothing with Redis away."""
    try:
        measured, _ = memory.latest(names)
    except redis.RedisError:
        return {}
    on = dict(Replica.objects.filter(pk__in=list(measured)).values_list("pk", "node__name"))
    totals: dict[str, int] = {}
    for pk, found in measured.items():
        if on.get(pk) == found.node:  # a node speaks only for its own replicas
            totals[found.node] = totals.get(found.node, 0) + found.host
    return totals


def nodes() -> dict:
    deadline = heartbeat_deadline()
    counts = Node.objects.aggregate(
        n_all=Count("pk"),
        n_draining=Count("pk", filter=Q(draining=True)),
        n_ready=Count("pk", filter=Q(draining=False, last_heartbeat__gte=deadline)),
        memory=Sum("memory_gb"),
    )
    # Placement books every replica on its node, whatever its state.
    used = dict(
        Replica.objects.filter(node__isnull=False).values_list("node_id").annotate(gb=Sum("memory_gb")).order_by()
    )
    bars = []
    for pk, name, total, last_heartbeat, draining in Node.objects.values_list(
        "pk", "name", "memory_gb", "last_heartbeat", "draining"
    ):
        placed = used.get(pk) or 0
        bars.append(
            {
                "name": name,
                "total": total,
                "placed": placed,
                "percent": min(100, round(100 * placed / total)) if total else 0,
                "ready": not draining and last_heartbeat is not None and last_heartbeat >= deadline,
            }
        )
    bars.sort(key=lambda b: (-b["percent"], b["name"]))
    hidden, bars = max(0, len(bars) - NODES_SHOWN), bars[:NODES_SHOWN]
    in_use = _in_use([b["name"] for b in bars])
    for bar in bars:
        bar["in_use"] = in_use.get(bar["name"])
    return {
        "ready": counts["n_ready"],
        "draining": counts["n_draining"],
        "not_ready": counts["n_all"] - counts["n_ready"] - counts["n_draining"],
        "total": counts["n_all"],
        "memory_gb": counts["memory"] or 0,
        "memory_placed_gb": sum(used.values()),
        "bars": bars,
        "bars_hidden": hidden,
    }


def replicas() -> list[dict]:
    counts = dict(Replica.objects.values_list("state").annotate(n=Count("pk")).order_by())
    return [{"state": state, "count": counts.get(state, 0)} for state in Replica.State.values]


def fetches_under_way() -> list[dict]:
    """Fetches a node is working on now, from the progress keys; Redis away means none shown."""
    try:
        enrolled = Node.objects.values_list("name", flat=True)
        recent = progress.read_recent(redis_client(), enrolled, SOURCES_LOOKED_AT)
    except Exception:
        return []
    rows = []
    for source, snapshots in recent:
        for node, snapshot in snapshots.items():
            if snapshot.get("state") not in LIVE_STATES:
                continue
            rows.append(
                {
                    "node": node,
                    "source": source,
                    "state": snapshot["state"],
                    "percent": progress.percent(snapshot),
                    "bytes_done": snapshot.get("bytes_done") or 0,
                    "bytes_total": snapshot.get("bytes_total") or 0,
                    "rate": snapshot.get("rate") or 0,
                }
            )
    return rows


def engines() -> list[dict]:
    """Per model, what its engines say of their load (fleet.engine_stats): slots busy, deferred, KV cache, tokens/s."""
    stats = engine_stats.read()
    if not stats:
        return []
    rows: dict[str, dict] = {}
    for pk, model in Replica.objects.filter(pk__in=stats).values_list("pk", "model_name"):
        found = stats[pk]
        row = rows.setdefault(
            model, {"model": model, "replicas": 0, "slots": 0, "busy": 0, "deferred": 0, "kv": 0.0, "tps": 0.0}
        )
        row["replicas"] += 1
        row["slots"] += found["slots"]
        row["busy"] += found["slots_busy"]
        row["deferred"] += found["requests_deferred"]
        row["kv"] += found["kv_cache_used"]
        row["tps"] += found["tokens_per_second"]
    for row in rows.values():
        row["kv_percent"] = round(100 * row.pop("kv") / row["replicas"])
        row["tokens_per_second"] = round(row.pop("tps"), 1)
    return sorted(rows.values(), key=lambda r: r["model"])
