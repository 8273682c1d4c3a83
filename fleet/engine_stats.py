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
    # Each node's own hash: a replica's stats are read only from the hash of the node it is on.
    keys = dict(Node.objects.filter(replicas__isnull=False).distinct().values_list("name", "token_hash"))
    if not keys:
        return {}
    names = sorted(keys)
    try:
        client = client or redis_client()
        pipe = client.pipeline(transaction=False)
        for name in names:
            pipe.hgetall(contract.stats_key(name))
        answers = pipe.execute()
    except Exception:
        return {}  # Redis away: the engines' numbers are missing, the gateway's count is not
    posted: dict[int, tuple[str, bytes]] = {}
    for name, raw in zip(names, answers, strict=True):
        for field, value in raw.items():
            field = field.decode() if isinstance(field, bytes) else str(field)
            if field.isdigit():
                posted[int(field)] = (name, value)
    if not posted:
        return {}
    on_node = dict(Replica.objects.filter(pk__in=posted, node__isnull=False).values_list("pk", "node__name"))
    found, dead = {}, []
    for replica_id, (name, value) in posted.items():
        node = on_node.get(replica_id)
        stats = contract.decode(value, {node: keys[name]} if node == name else {}, now)
        if stats is not None:
            found[replica_id] = stats
        elif node != name or _older_than(value, now, FORGET_AFTER_S):
            dead.append((name, str(replica_id)))
    if dead:
        try:
            pipe = client.pipeline(transaction=False)
            for name, field in dead:
                pipe.hdel(contract.stats_key(name), field)
            pipe.execute()
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
