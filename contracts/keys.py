"""The Redis keys a node writes, each under its own prefix `llmgw:node:NAME:`.

Written once here for both sides. One prefix per node is what lets a Redis ACL give node
NAME write access to exactly `llmgw:node:NAME:*` (docs/fleet.md): another principal can
then neither overwrite nor delete a node's entries. Node names are plain
(contracts/names.py: no `:` and no glob characters), so a prefix never holds another's.
"""

from __future__ import annotations

NODE_PREFIX = "llmgw:node:"


def node_prefix(name: str) -> str:
    return f"{NODE_PREFIX}{name}:"


def heartbeat_key(name: str) -> str:
    """The node's latest heartbeat (a string: its signed message, JSON), until the control plane collects it."""
    return node_prefix(name) + "heartbeat"


def reports_key(name: str) -> str:
    """The node's repeated replica reports (a hash: field replica id, value its signed message, JSON)."""
    return node_prefix(name) + "reports"


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


# --- the swarm's records, written by the byte listener (issues 24, 38) --------------------
# Nodes may read them (fleet/redis_acl.py), never write: with the byte listener's host gone, a
# node still finds a version's manifest, its torrent and its peers here (docs/mirror.md).

SWARM_PREFIX = "llmgw:swarm:"  # a hash per torrent: node name -> its record (host, port, at, mac)
SWARM_FLEET = "llmgw:swarm-fleet"  # a hash: node name -> its record, every node that announced lately


def swarm_version_key(model: str, version: str) -> str:
    """A hash: the version's manifest (`manifest`, JSON as the byte listener answers it), its torrent's
    info-hash (`info_hash`) and the torrent itself (`torrent`, bencoded), as the byte listener last served them."""
    return f"llmgw:swarm-version:{model}/{version}"


# A set: the versions ("model/version") whose manifest and torrent are in Redis, for the tracker to vouch for.
SWARM_VERSIONS = "llmgw:swarm-versions"
