"""The steps a staff member takes to put the tiny model into service, as the live tests take them:
weights into the mirror, a node enrolled, the plan read and `POST /api/serve/`."""

from __future__ import annotations

from pathlib import Path

from fleet.models import Node
from launcher.demo_model import write_tiny_llama
from mirror import scan

from ..staff_api import token_session
from .mirror import put
from .waiting import wait_until


def mirror_tiny(mirror_root: Path, work: Path) -> None:
    """The tiny three-file GGUF as tiny/v1 in the mirror, settled and scanned."""
    write_tiny_llama(work / "gguf")
    put(mirror_root, "tiny", "v1", {p.name: p.read_bytes() for p in (work / "gguf").glob("*.gguf")})
    scan.scan_mirror()


def wait_enrolled(agent, name: str, timeout: float = 60) -> None:
    """Until the node's heartbeat says it is ready with llama.cpp; fails at once if its agent exited."""

    def enrolled():
        if not agent.alive():
            raise AssertionError(f"the agent of {name} exited:\n{agent.output()[-4000:]}")
        node = Node.objects.filter(name=name).first()
        return node is not None and node.state == Node.State.READY and "llamacpp" in node.engines

    wait_until(enrolled, timeout=timeout, interval=0.5, what=f"{name}'s heartbeat\n{agent.output()[-3000:]}")


def serve_tiny(live_server, replicas: int = 1) -> dict:
    """`POST /api/serve/` of tiny/v1 as its plan proposes, a context of 256; returns the plan."""
    api = token_session()
    plan = api.get(live_server.url + "/api/serve/plan/?model=tiny&version=v1").json()
    served = api.post(
        live_server.url + "/api/serve/",
        json={
            "name": "tiny",
            "source": plan["source"],
            "engine": plan["engine"],
            "profile": plan["profile"],
            "context_length": 256,
            "ctx_size": 256,
            "replicas": replicas,
            "min_memory_gb": plan["min_memory_gb"],
        },
    )
    assert served.status_code == 201, served.text
    return plan
