"""Where a node's llama-server is: the one binary the llamacpp engine runs.

In this order, the first that is there:

1. `LLMGW_LLAMA_SERVER`, a path: for a node that installs llama.cpp some other way.
2. `llama-server` on `PATH`: what an operator puts there is what runs.
3. `llama-server` beside the agent's interpreter (the venv's `bin/`), where
   `make engine` links the build for this CPU (`scripts/build-engine.sh`, kept under
   `~/.cache/llmgw/engines/<key>/`): what a checkout's agent and the tests use.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

SETTING = "LLMGW_LLAMA_SERVER"
MISSING = (
    "llama.cpp's llama-server is not installed on this node: run `make engine` "
    f"(scripts/build-engine.sh), or set {SETTING} to its path"
)


def llama_server(which: Callable[[str], str | None] = shutil.which) -> str | None:
    """The llama-server this node runs, or None when it has none."""
    if configured := os.environ.get(SETTING, "").strip():
        return configured if os.access(configured, os.X_OK) else None
    if found := which("llama-server"):
        return found
    beside = Path(sys.executable).parent / "llama-server"
    return str(beside) if os.access(beside, os.X_OK) else None
