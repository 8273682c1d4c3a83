"""The fleet at a glance, for `manage.py fleet_status`: models, nodes and replicas, as the rows say now.

Plain data (lists of dicts of strings and numbers), so the table and `--json` are the
same facts, and a script reading the JSON sees what an operator reads in the table.
"""

from __future__ import annotations

from collections import Counter

from catalog.models import Model

from .models import Node, Replica


def fleet_status() -> dict[str, list[dict]]:
    replicas = list(Replica.objects.select_related("node").order_by("model_name", "pk"))
    ready = Counter(r.model_name for r in replicas if r.state == Replica.State.READY)
    every = Counter(r.model_name for r in replicas)
    on_node = Counter(r.node_id for r in replicas if r.node_id)
    return {
        "models": [
            {
                "name": model.name,
                "kind": model.kind,
                "replicas_ready": ready[model.name],
                "replicas": every[model.name],
                "scaling": f"{model.scaling_min}-{model.scaling_max}",
            }
            for model in Model.objects.order_by("name")
        ],
        "nodes": [
            {
                "name": node.name,
                "state": str(node.state),
                "memory_gb": node.memory_gb,
                "gpus": node.gpu_total,
                "replicas": on_node[node.pk],
                "agent_version": node.agent_version,
                "last_heartbeat": node.last_heartbeat.isoformat() if node.last_heartbeat else None,
            }
            for node in Node.objects.order_by("name")
        ],
        "replicas": [
            {
                "id": replica.pk,
                "model": replica.model_name,
                "profile": replica.profile_name,
                "node": replica.node.name if replica.node else None,
                "state": replica.state,
                "endpoint": replica.endpoint,
                "reason": replica.reason,
            }
            for replica in replicas
        ],
    }


def table(rows: list[dict], columns: list[str]) -> list[str]:
    """Rows as aligned text columns; an empty list says "none"."""
    if not rows:
        return ["  (none)"]
    cells = [[("" if row[c] is None else str(row[c])) for c in columns] for row in rows]
    widths = [max(len(c), *(len(line[i]) for line in cells)) for i, c in enumerate(columns)]
    lines = ["  " + "  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip()]
    for line in cells:
        lines.append("  " + "  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip())
    return lines
