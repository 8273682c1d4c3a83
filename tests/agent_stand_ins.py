"""STAND-INS for the agent issue's `agent.runtime` and `agent.fetch`, until that branch is merged.

This branch may not have those modules (another engineer writes them), yet the
replica path has to be shown through a real node worker. So the node worker in
tests/test_replicas_live.py is started through this module, which installs these
minimal stand-ins only when the real modules cannot be imported. Once the agent
branch is merged the real ones are found first and this file is dead: delete it.

The fetch here is the simplest thing that works over the real byte listener (no
resume, no hashes, no progress); the real one's rules are the agent issue's tests.
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path
from urllib.parse import urlparse


def _runtime() -> types.ModuleType:
    module = types.ModuleType("agent.runtime")
    module.node_name = lambda: os.environ["LLMGW_NODE"]
    module.cache_dir = lambda: Path(os.environ["LLMGW_AGENT_CACHE"])
    module.token = lambda: os.environ["LLMGW_NODE_TOKEN"]
    return module


def _fetch() -> types.ModuleType:
    import requests

    module = types.ModuleType("agent.fetch")

    class FetchError(Exception):
        pass

    def fetch_source(source: str, cache: Path, progress=None) -> Path:
        target = Path(cache) / "weights" / urlparse(source).path.strip("/")
        if not source.endswith("/"):
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(requests.get(source, timeout=30).content)
            return target
        if (target / ".complete").exists():
            return target
        manifest = requests.get(source, timeout=30).json()
        target.mkdir(parents=True, exist_ok=True)
        for file in manifest["files"]:
            (target / file["name"]).write_bytes(requests.get(source + file["name"], timeout=30).content)
        (target / ".complete").write_text(source)
        return target

    module.FetchError = FetchError
    module.fetch_source = fetch_source
    return module


def install() -> None:
    import agent

    for name, build in (("runtime", _runtime), ("fetch", _fetch)):
        try:
            __import__(f"agent.{name}")
        except ImportError:
            sys.modules[f"agent.{name}"] = module = build()
            setattr(agent, name, module)


if __name__ == "__main__":
    # python -m tests.agent_stand_ins worker ...: a Celery worker with the stand-ins in place.
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")
    install()
    from celery.bin.celery import main

    sys.argv = ["celery", "-A", "llmgw_site", *sys.argv[1:]]
    sys.exit(main())
