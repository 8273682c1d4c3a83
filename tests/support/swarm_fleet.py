"""A swarm's fleet on network namespaces: a mirror of made-up weights, Redis and the byte listener, three nodes.

What tests/test_swarm_fleet.py and tests/test_fetch_without_mirror.py both start: the control plane's
part a fetch needs (tests/fleet_netns.py, `whole=False`) and a node per name, each running its agent
with a short stall so that a stalled source is seen in seconds.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import redis

from agent.fetch import cache_path
from contracts import progress as contracts_progress
from fleet.enrolment import issue_token

from .. import netns
from ..fleet_netns import ControlPlane, Node
from .mirror import settle
from .waiting import wait_until

# Short, so that a stall is seen in seconds: under 64 KiB/s for 3 s is a stall.
STALL = {"LLMGW_FETCH_STALL_S": "3", "LLMGW_FETCH_STALL_BYTES_S": str(64 << 10)}


def content(name: str, size: int) -> bytes:
    """`size` bytes that differ for every name: a file of made-up weights."""
    block = b"".join(hashlib.sha256(f"{name}:{i}".encode()).digest() for i in range(4096))
    return (block * (size // len(block) + 1))[:size]


@contextmanager
def swarm_fleet_on_a_bridge(
    log_dir: Path, versions: dict[str, dict[str, int]], names: tuple[str, ...] = ("n1", "n2", "n3")
) -> Iterator[tuple[netns.Fleet, ControlPlane, dict[str, Node]]]:
    """The mirror holds model "tiny" at each version's files; each named node runs its agent. All gone after."""
    network = netns.Fleet()
    control = None
    nodes: dict[str, Node] = {}
    try:
        mirror = log_dir / "mirror"
        for version, files in versions.items():
            (mirror / "tiny" / version).mkdir(parents=True)
            for name, size in files.items():
                (mirror / "tiny" / version / name).write_bytes(content(version + name, size))
        settle(mirror)
        control = ControlPlane(network, mirror, log_dir, whole=False)
        for name in names:
            node = Node(name, network.add_host(name), issue_token(name), control, log_dir)
            env = {**Node.env(node), **STALL}
            node.env = lambda env=env: env  # one peer port for the node's whole life
            nodes[name] = node
        with ThreadPoolExecutor(len(nodes)) as pool:  # the agents start together: each start waits on its own
            list(pool.map(Node.start_agent, nodes.values()))
        yield network, control, nodes
    finally:
        for node in nodes.values():
            node.kill_everything()
        if control is not None:
            control.stop()
        network.remove()


def source_of(control: ControlPlane, version: str) -> str:
    return control.bytes_url + f"tiny/{version}/"


def progress_of(control: ControlPlane, node: Node, source: str) -> dict:
    client = redis.Redis.from_url(control.redis_url, socket_timeout=5)
    return contracts_progress.read_one(client, node.name, source) or {}


def fetched(control: ControlPlane, node: Node, version: str, timeout: float = 90) -> dict:
    """Until the node's progress on the version says complete (a failure says why at once); its last progress."""
    source = source_of(control, version)

    def complete():
        said = progress_of(control, node, source)
        if said.get("state") == "failed":
            raise AssertionError(f"{node.name}'s fetch of {version} failed: {said}\n{node.agent.output()[-3000:]}")
        return said.get("state") == "complete" and said

    return wait_until(
        complete,
        timeout,
        what=lambda: f"{node.name} to fetch {version}: {progress_of(control, node, source)}\n"
        f"{node.agent.output()[-3000:]}",
        interval=0.3,
    )


def assert_same_as_the_mirror(control: ControlPlane, node: Node, version: str) -> None:
    directory = cache_path(source_of(control, version), node.cache)
    assert (directory / ".complete").exists()
    mirrored = control.mirror / "tiny" / version
    names = sorted(p.name for p in mirrored.iterdir() if not p.name.startswith("."))
    assert names, f"{mirrored} holds no file"
    for name in names:
        assert (directory / name).read_bytes() == (mirrored / name).read_bytes(), name
