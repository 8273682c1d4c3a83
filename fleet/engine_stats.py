"""The engines' own count of their load, as each node posts it (contracts/engine_stats.py): read live.

Believed only for a replica on the node whose token signed it, and only while fresh.
The autoscaler reads it every pass, the replicas page, the overview and `/metrics` when
they are looked at; nothing of it goes into the database.
"""

from __future__ import annotations

import json
import time

from contracts import engine_stats as contract
from contracts.engine_stats import EngineStats

from .live import redis_client
from .models import Node, Replica

# Fields for replicas gone this long are removed from the hash: nobody posts them any more.
FORGET_AFTER_S = 600


def read(now: float | None = None, client=None) -> dict[int, EngineStats]:
    """{replica id: stats} for every replica whose node posted fresh, signed stats for it."""
    now = time.time() if now is None else now
    try:
        client = client or redis_client()
        raw = client.hgetall(contract.STATS_KEY)
    except Exception:
        return {}  # Redis away: the engines' numbers are missing, the gateway's count is not
    if not raw:
        return {}
    ids = {}
    for field, value in raw.items():
        name = field.decode() if isinstance(field, bytes) else str(field)
        if name.isdigit():
            ids[int(name)] = value
    on_node = dict(Replica.objects.filter(pk__in=ids, node__isnull=False).values_list("pk", "node__name"))
    keys = dict(Node.objects.filter(name__in=set(on_node.values())).values_list("name", "token_hash"))
    found, dead = {}, []
    for replica_id, value in ids.items():
        node = on_node.get(replica_id)
        stats = contract.decode(value, {node: keys.get(node, "")} if node else {}, now)
        if stats is not None:
            found[replica_id] = stats
        elif node is None or _older_than(value, now, FORGET_AFTER_S):
            dead.append(str(replica_id))
    if dead:
        try:
            client.hdel(contract.STATS_KEY, *dead)
        except Exception:
            pass
    return found


def _older_than(value, now: float, seconds: float) -> bool:
    try:
        return now - float(json.loads(value)["stats"]["at"]) > seconds
    except (ValueError, TypeError, KeyError):
        return True


def model_totals(stats: dict[int, EngineStats], replicas) -> dict[str, tuple[int, int, int]]:
    """{model: (slots, slots busy, requests deferred)} over its replicas whose engines said."""
    totals: dict[str, tuple[int, int, int]] = {}
    for replica in replicas:
        found = stats.get(replica.pk)
        if found is None:
            continue
        slots, busy, deferred = totals.get(replica.model_name, (0, 0, 0))
        totals[replica.model_name] = (
            slots + found["slots"],
            busy + found["slots_busy"],
            deferred + found["requests_deferred"],
        )
    return totals
