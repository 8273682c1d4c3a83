"""A fleet at the size the overview page must answer for: 1,000 nodes, 500 models, 30 days of usage.

Used by tests/test_overview.py (which counts the page's queries) and bench/overview.py
(which times it). Written with bulk_create: a few seconds on SQLite.
"""

from __future__ import annotations

from datetime import timedelta

from django.utils import timezone

NODES = 1000
MODELS = 500
DAYS = 30
KEYS = 3


def build_fleet_at_scale() -> dict:
    from fleet.models import Node, Replica
    from gateway.models import ApiKey, Usage

    now = timezone.now()
    Node.objects.bulk_create(
        Node(
            name=f"node-{i:04d}",
            memory_gb=(16, 32, 64, 128)[i % 4],
            gpus=[{"name": "L4", "memory_mb": 24000}] * (i % 3),
            engines=["llamacpp"],
            last_heartbeat=now if i % 10 else now - timedelta(hours=1),
            draining=i % 97 == 0,
        )
        for i in range(NODES)
    )
    nodes = list(Node.objects.values_list("pk", flat=True))
    states = ("ready", "ready", "ready", "fetching", "starting", "failed", "pending")
    Replica.objects.bulk_create(
        Replica(
            model_name=f"model-{m:03d}",
            profile_name="cpu",
            node_id=nodes[(2 * m + r) % NODES],
            state=states[(m + r) % len(states)],
            memory_gb=4 + (m % 5) * 2,
        )
        for m in range(MODELS)
        for r in range(2)
    )
    keys = ApiKey.objects.bulk_create(
        ApiKey(name=f"team-{k}", prefix=f"p{k}", key_hash=f"{k:064d}") for k in range(KEYS)
    )
    today = timezone.localdate()
    Usage.objects.bulk_create(
        (
            Usage(
                key=key,
                model_name=f"model-{m:03d}",
                day=today - timedelta(days=d),
                requests=1 + (m * 7 + d) % 50,
                prompt_tokens=100 * (1 + m % 13),
                completion_tokens=40 * (1 + d % 7),
            )
            for key in keys
            for m in range(MODELS)
            for d in range(DAYS)
        ),
        batch_size=5000,
    )
    return {"nodes": NODES, "models": MODELS, "usage_rows": KEYS * MODELS * DAYS}
