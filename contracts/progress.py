"""Live progress of fetches in Redis: written by nodes, read by the control plane.

Each node writes under its own prefix (contracts.keys): a hash with one field per source
(a version's address for a set, because that is what everything waiting on it asked for)
and a sorted set of those sources by when they last moved. A node can write nowhere else
(the Redis ACL), so no node overwrites or deletes another's progress; a reader asks the
nodes it knows, in one pipeline.
"""

from __future__ import annotations

import heapq
import json

from .keys import fetch_cancel_key, progress_key, progress_sources_key

STATES = ("queued", "fetching", "verifying", "complete", "failed")

# Long enough to read what happened overnight, short enough not to pile up.
KEEP_S = 7 * 24 * 3600

__all__ = [
    "STATES",
    "KEEP_S",
    "cancel_key",
    "progress_key",
    "progress_sources_key",
    "percent",
    "read",
    "read_one",
    "read_recent",
    "recent_sources",
    "request_cancel",
    "clear_cancel",
]

cancel_key = fetch_cancel_key


def percent(snapshot: dict) -> float:
    """How far a fetch is, 0 to 100; a complete fetch of nothing is 100."""
    total = snapshot.get("bytes_total") or 0
    if not total:
        return 100.0 if snapshot.get("state") == "complete" else 0.0
    return round(min(100.0, 100 * (snapshot.get("bytes_done") or 0) / total), 1)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _parsed(value) -> dict | None:
    if value is None:
        return None
    try:
        snapshot = json.loads(value)
    except ValueError:
        return None
    return snapshot if isinstance(snapshot, dict) else None


def read(client, source: str, nodes) -> dict[str, dict]:
    """The progress of each of `nodes` (names) on this source: {node: snapshot}, for those that have one."""
    nodes = sorted(set(nodes))
    if not nodes:
        return {}
    pipe = client.pipeline(transaction=False)
    for node in nodes:
        pipe.hget(progress_key(node), source)
    out = {}
    for node, value in zip(nodes, pipe.execute(), strict=True):
        snapshot = _parsed(value)
        if snapshot is not None:
            out[node] = snapshot
    return out


def read_one(client, node: str, source: str) -> dict | None:
    return _parsed(client.hget(progress_key(node), source))


def recent_sources(client, nodes, limit: int = 200) -> list[tuple[str, list[str]]]:
    """The sources `nodes` moved on most recently, newest first, with the nodes that have each:
    [(source, [node, ...]), ...], `limit` sources at most."""
    nodes = sorted(set(nodes))
    if not nodes:
        return []
    pipe = client.pipeline(transaction=False)
    for node in nodes:
        pipe.zrevrange(progress_sources_key(node), 0, limit - 1, withscores=True)
    newest: dict[str, float] = {}
    holders: dict[str, list[str]] = {}
    for node, listed in zip(nodes, pipe.execute(), strict=True):
        for raw, score in listed:
            source = _text(raw)
            newest[source] = max(score, newest.get(source, score))
            holders.setdefault(source, []).append(node)
    chosen = heapq.nlargest(limit, newest, key=lambda s: (newest[s], s))
    return [(source, holders[source]) for source in chosen]


def read_recent(client, nodes, limit: int = 200) -> list[tuple[str, dict[str, dict]]]:
    """The newest `limit` sources of `nodes` with every node's snapshot of each: [(source, {node: snapshot})]."""
    listed = recent_sources(client, nodes, limit)
    if not listed:
        return []
    pipe = client.pipeline(transaction=False)
    for source, holders in listed:
        for node in holders:
            pipe.hget(progress_key(node), source)
    answers = iter(pipe.execute())
    out = []
    for source, holders in listed:
        found = {}
        for node in holders:
            snapshot = _parsed(next(answers))
            if snapshot is not None:
                found[node] = snapshot
        out.append((source, dict(sorted(found.items()))))
    return out


def request_cancel(client, node: str, source: str) -> None:
    client.set(cancel_key(node, source), "1", ex=KEEP_S)


def clear_cancel(client, node: str, source: str) -> None:
    client.delete(cancel_key(node, source))
