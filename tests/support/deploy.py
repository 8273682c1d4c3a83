"""A fleet deployed the way docs/fleet.md and deploy/ say, for tests/test_deploy_as_operator.py.

What an operator copies is read from those files here, never copied into the test: the
nftables rules from fleet.md (between its `<!-- firewall: ROLE -->` markers), the units
from deploy/systemd/, the env files from deploy/env/.
"""

from __future__ import annotations

import re
import subprocess
import sys

from .processes import BASE_DIR

FLEET_DOC = BASE_DIR / "docs" / "fleet.md"
EXAMPLE_ADDRESS = re.compile(r"\b10\.0\.0\.\d+\b")


def _block_after(marker: str) -> str:
    text = FLEET_DOC.read_text()
    at = text.find(marker)
    assert at >= 0, f"docs/fleet.md has no {marker}"
    found = re.compile(r"```[a-z]*\n(.*?)```", re.S).search(text, at)
    return found.group(1)


def firewall(role: str, addresses: dict[str, str]) -> str:
    """fleet.md's nftables rules for `role` (control, gateway, node), its example addresses replaced by `addresses`."""
    rules = _block_after("<!-- firewall: control -->")
    if role != "control":
        lines = rules.splitlines()
        first = next(i for i, line in enumerate(lines) if "tcp dport { 80, 443 } accept" in line)
        own = _block_after(f"<!-- firewall: {role} -->").splitlines()
        # "the same with the last three accept lines replaced by" the role's own
        rules = "\n".join(lines[:first] + own + lines[first + 3 :]) + "\n"

    def replace(found: re.Match) -> str:
        return addresses.get(found.group(0), "192.0.2.1")  # an example host this fleet lacks: TEST-NET, never routed

    return EXAMPLE_ADDRESS.sub(replace, rules)


def apply_firewall(netns: str, rules: str) -> None:
    applied = subprocess.run(
        ["ip", "netns", "exec", netns, "nft", "-f", "-"], input=rules, capture_output=True, text=True, timeout=30
    )
    assert applied.returncode == 0, f"nft refused fleet.md's rules:\n{applied.stderr}\n{rules}"


# A listener and a client that run inside a namespace: one line of Python each, no port of this host.
LISTEN = (
    "import socket,sys\n"
    "s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(8); print('listening', flush=True)\n"
    "while True:\n    c,_=s.accept(); c.sendall(b'hello'); c.close()\n"
)
CONNECT = (
    "import socket,sys\n"
    "try:\n    c=socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))\n"
    "    print(c.recv(5).decode())\n"
    "except OSError as e:\n    print('failed:', e)\n"
)


def listen(netns: str, address: str, port: int) -> subprocess.Popen:
    listener = subprocess.Popen(
        ["ip", "netns", "exec", netns, sys.executable, "-c", LISTEN, address, str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert listener.stdout.readline().strip() == "listening"
    return listener


def connects(netns: str, address: str, port: int, timeout: float = 3.0) -> bool:
    """Whether a connection from `netns` to address:port gets the listener's hello within `timeout`."""
    said = subprocess.run(
        ["ip", "netns", "exec", netns, sys.executable, "-c", CONNECT, address, str(port), str(timeout)],
        capture_output=True,
        text=True,
        timeout=timeout + 30,
    )
    return said.stdout.strip() == "hello"
