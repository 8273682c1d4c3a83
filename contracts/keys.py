"""Where each thing a node writes lives in Redis: every key under the node's own prefix.

So a Redis ACL (fleet/redis_acl.py) gives node NAME write access to `llmgw:node:NAME:*`,
its own queue and a push onto the control queue, and nothing of another node's. Node
names (contracts.names) hold no glob character and no ':', so a prefix is a pattern.
"""

from __future__ import annotations

NODE_PREFIX = "llmgw:node:"


def node_prefix(name: str) -> str:
    return f"{NODE_PREFIX}{name}:"


# --- fetch progress, cancel, engine stats (issue 33, helper h2) --------------------------


def progress_key(name: str) -> str:
    """A hash: one field per source the node fetched, its latest progress snapshot (JSON)."""
    return node_prefix(name) + "progress"


def progress_sources_key(name: str) -> str:
    """A sorted set: the sources in the node's progress hash, scored by when they last moved."""
    return node_prefix(name) + "progress-sources"


def fetch_cancel_key(name: str, source: str) -> str:
    """Set by the control plane when staff cancel the node's fetch of `source`; the node reads and deletes it."""
    return node_prefix(name) + "fetch-cancel:" + source


def engine_stats_key(name: str) -> str:
    """A hash: one field per replica on the node, its engine's signed load (contracts.engine_stats)."""
    return node_prefix(name) + "engine-stats"


def unacked_keys(name: str) -> dict[str, str]:
    """The node's own bookkeeping of the tasks it took and has not finished (kombu's Redis transport options).

    kombu's default is one `unacked` hash for every consumer of the broker: every node
    would need to read and write the others' tasks (orders, with their arguments) there.
    """
    queue = f"node.{name}"
    return {
        "unacked_key": f"unacked:{queue}",
        "unacked_index_key": f"unacked_index:{queue}",
        "unacked_mutex_key": f"unacked_mutex:{queue}",
    }
