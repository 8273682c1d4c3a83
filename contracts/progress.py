"""Live progress of fetches in Redis: written by nodes, read by the control plane.

Kept under the source's own address (a version's address for a set), because that
is what everything waiting on it asked for. One hash per address, one field per
node, so two nodes fetching the same version do not overwrite each other.
"""

from __future__ import annotations

import json

STATES = ("queued", "fetching", "verifying", "complete", "failed")

KEY_PREFIX = "llmgw:progress:"
# Every address with progress, newest first: what the fleet page lists.
SOURCES_KEY = "llmgw:progress-sources"
CANCEL_PREFIX = "llmgw:fetch-cancel:"
# Long enough to read what happened overnight, short enough not to pile up.
KEEP_S = 7 * 24 * 3600


def progress_key(source: str) -> str:
    return KEY_PREFIX + source


def cancel_key(node: str, source: str) -> str:
    return f"{CANCEL_PREFIX}{node}:{source}"


def percent(snapshot: dict) -> float:
    """How far a fetch is, 0 to 100; a complete fetch of nothing is 100."""
    total = snapshot.get("bytes_total") or 0
    if not total:
        return 100.0 if snapshot.get("state") == "complete" else 0.0
    return round(min(100.0, 100 * (snapshot.get("bytes_done") or 0) / total), 1)


def read(client, source: str) -> dict[str, dict]:
    """Every node's progress on this source: {node: snapshot}."""
    raw = client.hgetall(progress_key(source))
    out = {}
    for node, value in raw.items():
        node = node.decode() if isinstance(node, bytes) else node
        try:
            out[node] = json.loads(value)
        except ValueError:
            continue
    return dict(sorted(out.items()))


def recent_sources(client, limit: int = 200) -> list[str]:
    return [s.decode() if isinstance(s, bytes) else s for s in client.zrevrange(SOURCES_KEY, 0, limit - 1)]


def request_cancel(client, node: str, source: str) -> None:
    client.set(cancel_key(node, source), "1", ex=KEEP_S)


def clear_cancel(client, node: str, source: str) -> None:
    client.delete(cancel_key(node, source))
