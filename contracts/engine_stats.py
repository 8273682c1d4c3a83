"""What an engine knows about its own load, as a node posts it and the control plane reads it.

llama-server counts what the gateway can only guess: how many of its slots are decoding,
how many requests wait for a slot, how full its KV cache is and how fast it generates.
Each node's supervisor reads its engines' `/metrics` every few seconds and writes one
field per replica into a Redis hash of its own (contracts.keys.engine_stats_key); the autoscaler, the replicas page, the overview and
the control plane's `/metrics` read the hash when they need it (live numbers, like a
fetch's progress; nothing is written to the database).

A node's Redis user writes only its own hash; and where Redis has one password for all
(no ACL), an entry is believed only with a proof keyed by the node's token hash (`contracts.signing`, as the control plane's orders are): a node
cannot make another node's replicas look busy. And only while fresh: a node that stops
posting (gone, its supervisor stopped) stops counting after `FRESH_S`.
"""

from __future__ import annotations

import json
import time
from typing import TypedDict

from . import signing
from .keys import engine_stats_key

# The node's hash (engine_stats_key(node)): field: replica id; value: JSON {node, replica, stats, proof}
stats_key = engine_stats_key
# What the proof's MAC is made over, as a task name is for an order.
SIGNED_AS = "engine-stats"
INTERVAL_S = 5.0
FRESH_S = 30.0


class EngineStats(TypedDict):
    slots: int  # the engine's parallel slots
    slots_busy: int  # decoding a request now
    requests_deferred: int  # waiting for a slot
    kv_cache_used: float  # 0..1 of the context pool
    tokens_per_second: float  # generated, over the engine's last interval
    at: float  # when it was read, on the node's clock


def encode(node: str, token_hash: str, replica_id: int, stats: EngineStats) -> str:
    args = [replica_id, dict(stats)]
    return json.dumps(
        {
            "node": node,
            "replica": replica_id,
            "stats": dict(stats),
            "proof": signing.sign(token_hash, SIGNED_AS, node, args),
        }
    )


def decode(raw, token_hashes: dict[str, str], now: float | None = None) -> EngineStats | None:
    """The stats in one entry, when its node's proof holds and it is fresh; else None.

    `token_hashes` is {node name: token hash} of the nodes the caller believes.
    """
    try:
        entry = json.loads(raw)
        node, replica_id, stats = entry["node"], entry["replica"], entry["stats"]
    except (ValueError, TypeError, KeyError):
        return None
    key = token_hashes.get(node) if isinstance(node, str) else None
    if not key or not isinstance(stats, dict):
        return None
    if signing.proof_problem(key, SIGNED_AS, node, [replica_id, stats], None, entry.get("proof"), now):
        return None
    try:
        fresh = (time.time() if now is None else now) - float(stats["at"]) <= FRESH_S
        parsed = EngineStats(
            slots=int(stats["slots"]),
            slots_busy=int(stats["slots_busy"]),
            requests_deferred=int(stats["requests_deferred"]),
            kv_cache_used=float(stats["kv_cache_used"]),
            tokens_per_second=float(stats["tokens_per_second"]),
            at=float(stats["at"]),
        )
    except (KeyError, TypeError, ValueError):
        return None
    return parsed if fresh else None
