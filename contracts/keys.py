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
