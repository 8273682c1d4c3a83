"""Hosts as network namespaces, for the fleet test: a bridge on this host, a namespace per node.

The control plane stays on this host; each node is a network namespace with one
veth into the bridge and nothing else (no route out, no loopback of the host's), so
what a node reaches is what it could reach from another machine on the fleet's
network: the addresses on the bridge. Every name carries a tag made per run, and
`Fleet.remove` takes away only what this run made (the processes inside its own
namespaces, the namespaces, the bridge), at the end of the test however it ends.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import secrets
import shutil
import signal
import subprocess
from dataclasses import dataclass

# 10.231.N.0/24, N picked per run among those this host does not already use.
SUBNETS = ipaddress.ip_network("10.231.0.0/16")
# Held from the pick of a /24 until its address is on the bridge: two test processes at once
# (pytest-xdist's workers, another run) would otherwise both find N unused and both take it.
SUBNET_LOCK = "/run/lock/llmgw-test-netns-subnet.lock"


class NetnsError(Exception):
    pass


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and result.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result


def unavailable() -> str | None:
    """Why namespaces cannot be made here, as the one line `make test` prints; None when they can."""
    if shutil.which("ip") is None:
        return "the fleet test (hosts as network namespaces) was skipped: `ip` (iproute2) is not installed"
    if os.geteuid() != 0:
        return (
            "the fleet test (hosts as network namespaces) was skipped: it needs root for `ip netns` "
            "(run `make test` as root, as it already is for its packages)"
        )
    probe = f"llmgw-probe-{secrets.token_hex(3)}"
    made = ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"the fleet test (hosts as network namespaces) was skipped: `ip netns add` failed: {made.stderr.strip()}"
    ip("netns", "del", probe, check=False)
    return None


def _free_subnet() -> ipaddress.IPv4Network:
    used = ip("-4", "-o", "addr", "show").stdout + ip("-4", "route", "show").stdout
    candidates = list(SUBNETS.subnets(new_prefix=24))
    start = secrets.randbelow(len(candidates))
    for net in candidates[start:] + candidates[:start]:
        prefix = str(net.network_address).rsplit(".", 1)[0] + "."
        if prefix not in used:
            return net
    raise NetnsError("no free /24 in 10.231.0.0/16 for the test's bridge")


@dataclass
class Host:
    """One node's network namespace: its name, its address on the bridge, and its link."""

    name: str
    address: str
    veth: str  # the host's end, in the bridge: down is the node cut off

    def argv(self, command: list[str]) -> list[str]:
        """`command` run inside this namespace."""
        return ["ip", "netns", "exec", self.name, *command]

    def cut(self) -> None:
        ip("link", "set", self.veth, "down")

    def restore(self) -> None:
        ip("link", "set", self.veth, "up")

    def pids(self) -> list[int]:
        result = ip("netns", "pids", self.name, check=False)
        return [int(p) for p in result.stdout.split()]


class Fleet:
    """A bridge with an address on this host, and namespaces plugged into it."""

    def __init__(self) -> None:
        self.tag = secrets.token_hex(3)
        self.bridge = f"lg{self.tag}br"
        self.hosts: list[Host] = []
        os.makedirs(os.path.dirname(SUBNET_LOCK), exist_ok=True)
        with open(SUBNET_LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.network = _free_subnet()
            hosts = self.network.hosts()
            self.address = str(next(hosts))  # this host's, on the bridge: Redis and the byte listener
            self._addresses = hosts
            ip("link", "add", self.bridge, "type", "bridge")
            try:
                ip("addr", "add", f"{self.address}/{self.network.prefixlen}", "dev", self.bridge)
                ip("link", "set", self.bridge, "up")
            except NetnsError:
                self.remove()
                raise

    def add_host(self, label: str) -> Host:
        index = len(self.hosts) + 1
        host = Host(f"llmgw-{self.tag}-{label}", str(next(self._addresses)), f"lg{self.tag}h{index}")
        peer = f"lg{self.tag}n{index}"
        ip("netns", "add", host.name)
        self.hosts.append(host)
        ip("link", "add", host.veth, "type", "veth", "peer", "name", peer)
        ip("link", "set", peer, "netns", host.name)
        ip("link", "set", host.veth, "master", self.bridge, "up")
        ip("-n", host.name, "addr", "add", f"{host.address}/{self.network.prefixlen}", "dev", peer)
        ip("-n", host.name, "link", "set", peer, "up")
        # The node's own loopback (its engines' health checks), not the host's.
        ip("-n", host.name, "link", "set", "lo", "up")
        return host

    def remove(self) -> None:
        """Kill every process left in this run's namespaces, then remove them and the bridge."""
        for host in self.hosts:
            for pid in host.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            ip("netns", "del", host.name, check=False)  # takes its veth pair with it
        ip("link", "del", self.bridge, check=False)
