"""What a node's worker knows about itself, set by `manage.py agent` before the worker starts.

Environment variables rather than settings, so that the pool's child processes
and any task module (the engine tasks too) read the same values without a
database or a second configuration file.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from django.conf import settings

from contracts import signing

NODE_NAME = "LLMGW_NODE_NAME"
AGENT_CACHE = "LLMGW_AGENT_CACHE"
NODE_TOKEN = "LLMGW_NODE_TOKEN"


def node_name() -> str:
    return os.environ.get(NODE_NAME, "").strip()


def cache_dir() -> Path:
    raw = os.environ.get(AGENT_CACHE, "").strip()
    if raw:
        path = Path(raw)
        return path if path.is_absolute() else Path(settings.BASE_DIR) / path
    return Path(settings.AGENT_CACHE)


def token() -> str:
    return os.environ.get(NODE_TOKEN, "").strip()


def key() -> str:
    """The node's signing key, the sha256 of its token (what the control plane stores): derived here,
    so the token itself never leaves the node; "" without a token."""
    raw = token()
    return signing.token_hash(raw) if raw else ""


def stop_with_parent(parent: int, stop: threading.Event) -> None:
    """Set `stop` when the agent that started this process (the supervisor, the libtorrent session) is gone.

    Started in a daemon thread; returns once `stop` is set either way.
    """
    while not stop.is_set():
        if os.getppid() != parent:
            stop.set()
        stop.wait(1)
