"""One replica across two nodes as the node tests drive it: two supervisors, a wide model, RPC probes.

The head's and the worker's supervisors run in the test process, each with its own cache and
token, as the agent runs one (tests/support/engines.py step_until); what they start (llama-server,
rpc-server, stunnel) are the real programs.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from agent import rpc_group
from contracts import tiny_gguf

# rpc-server keeps a tensor in its cache only above 10 MiB (ggml-rpc.cpp HASH_THRESHOLD): the
# tiny model's are a few KiB. This one is the tiny model with a feed-forward wide enough that
# each of its six FFN matrices (F32) is 11.5 MB: 70 MB in all, two layers.
WIDE_FEED_FORWARD = 45056


def write_wide_llama(directory: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    with monkeypatch.context() as patch:
        patch.setattr(tiny_gguf, "FEED_FORWARD", WIDE_FEED_FORWARD)
        tiny_gguf.write_llama(Path(directory) / "wide.gguf", "wide", seed=4321)
    return Path(directory)


class Reports(list):
    """What a supervisor told the control plane: (replica, state, endpoint, reason, role)."""

    def __call__(self, replica_id, state, endpoint, reason, role=""):
        self.append((replica_id, state, endpoint, reason, role))

    def of(self, replica_id: int, role: str = "") -> list[tuple]:
        return [r for r in self if r[0] == replica_id and r[4] == role]

    def states(self, replica_id: int, role: str = "") -> list[str]:
        return [r[1] for r in self.of(replica_id, role)]


def worker_entry(cache: Path, replica_id: int) -> dict:
    path = rpc_group.Workers.wants_path(cache)
    return json.loads(path.read_text()).get(str(replica_id), {}) if path.exists() else {}


def bytes_to_rpc_server(log: Path) -> int | None:
    """What the worker's stunnel passed on to rpc-server, once every connection it accepted has
    closed (it logs each one's bytes then); None while one is still open."""
    text = log.read_text(errors="replace") if log.exists() else ""
    accepted = text.count("accepted connection")
    ended = re.findall(r"Connection [a-z/]+: \d+ byte\(s\) sent to TLS, (\d+) byte\(s\) sent to socket", text)
    if not accepted or len(ended) < accepted:
        return None
    return sum(int(n) for n in ended)


# Run inside another namespace by its own interpreter: the probes of a stranger on the fleet network.
PROBE = r"""
import socket, sys
host, port = sys.argv[1], int(sys.argv[2])
hello = bytes([14]) + (24).to_bytes(8, "little") + bytes(24)
try:
    with socket.create_connection((host, port), timeout=3) as s:
        s.settimeout(3)
        s.sendall(hello)
        got = s.recv(64)
    print("answered" if got else "closed")
except ConnectionRefusedError:
    print("refused")
except OSError as e:
    print("closed" if "reset" in str(e).lower() else f"error {e}")
"""


def probe(argv_prefix: list[str], python: str, host: str, port: int) -> str:
    """RPC's HELLO sent to host:port from where `argv_prefix` runs: answered, closed, refused."""
    done = subprocess.run([*argv_prefix, python, "-c", PROBE, host, str(port)], capture_output=True, text=True)
    return done.stdout.strip() or done.stderr.strip()


# For the checks that need only rpc-server's first exchange: a stand-in that answers HELLO as
# ggml-rpc.cpp does (8 bytes of size, 28 of version and capabilities) and keeps the connection.
STAND_IN = """#!{python}
import socket, sys
a = sys.argv
if "--help" in a:
    print("  -c, --cache  enable local file cache")
    sys.exit(0)
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((a[a.index("--host") + 1], int(a[a.index("--port") + 1])))
s.listen()
while True:
    c, _ = s.accept()
    data = b""
    while len(data) < 33 and (got := c.recv(64)):
        data += got
    if data[:1] == bytes([14]):
        c.sendall((28).to_bytes(8, "little") + bytes(28))
        while c.recv(4096):
            pass
    c.close()
"""
