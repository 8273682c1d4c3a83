"""Stand-ins for Ray's command line and for vLLM over Ray, which need GPUs this machine does not have.

They say what they are, and keep to what the agent relies on (contracts/ray.py):
- `ray start --head --port=P --node-ip-address=A --block` listens at A:P (its "GCS"), prints
  "Ray runtime started." and stays in the foreground, counting the workers that hold a connection;
- `ray start --address=A:P --node-ip-address=B --block` joins it (or exits 1, as Ray does when no
  head answers), prints "Ray runtime started." and stays until it is stopped or the head goes;
- `ray status --address=A:P` prints Ray's "Node status" with one " 1 node_<id>" line per node;
- `vllm --version` answers the agent's self-test; `vllm serve ... --distributed-executor-backend ray`
  asks RAY_ADDRESS's head how many nodes it has, records that, and then is the recording vLLM
  stand-in (tests/support/engines.py STAND_IN), which answers /v1/models behind VLLM_API_KEY.

Each records what it did, one JSON line with its pid, working directory and arguments, in
VLLM_RAY_STAND_IN_LOG (a VLLM_ variable, so it reaches engines through the agent's allow-list).
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

from .engines import STAND_IN

COMMON = textwrap.dedent(
    """\
    import json, os, socket, sys, threading, time

    def record(event, **more):
        line = {"event": event, "pid": os.getpid(), "cwd": os.getcwd(), "argv": sys.argv[1:], "at": time.time(), **more}
        with open(os.environ["VLLM_RAY_STAND_IN_LOG"], "a") as f:
            f.write(json.dumps(line) + "\\n")

    def option(name):
        return next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith(name + "=")), None)

    def nodes_at(address):
        host, port = address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(b"STATUS\\n")
            return int(s.makefile().readline())
    """
)

RAY = (
    "#!{python}\n# A STAND-IN for Ray's command line (no GPU here, no Ray installed): see tests/support/ray_stand_in.py.\n"
    + COMMON
    + textwrap.dedent(
        """\
    args = sys.argv[1:]
    if args[:2] == ["start", "--head"]:
        address = option("--node-ip-address")
        server = socket.create_server((address, int(option("--port"))))
        held, lock = [], threading.Lock()

        def serve(conn):
            words = conn.makefile("rb").readline().decode().split()
            if words[:1] == ["JOIN"]:
                with lock:
                    held.append(words[1])
                conn.sendall(b"OK\\n")
                conn.recv(1)  # held until the worker goes
                with lock:
                    held.remove(words[1])
            elif words[:1] == ["STATUS"]:
                with lock:
                    conn.sendall(f"{1 + len(held)}\\n".encode())
            conn.close()

        record("head")
        print("Ray runtime started.", flush=True)
        while True:
            conn, _ = server.accept()
            threading.Thread(target=serve, args=(conn,), daemon=True).start()
    elif args[:1] == ["start"]:
        head = option("--address")
        host, port = head.rsplit(":", 1)
        try:
            conn = socket.create_connection((host, int(port)), timeout=5)
        except OSError as e:
            print(f"ConnectionError: could not reach the head's GCS at {head}: {e}", flush=True)
            sys.exit(1)
        conn.sendall(f"JOIN {option('--node-ip-address')}\\n".encode())
        conn.makefile("rb").readline()
        record("join", head=head)
        print("Ray runtime started.", flush=True)
        conn.settimeout(None)
        conn.recv(1)
        print(f"the head's GCS at {head} went away", flush=True)
        sys.exit(1)
    elif args[:1] == ["status"]:
        try:
            count = nodes_at(option("--address"))
        except OSError:
            print("ConnectionError: Could not find any running Ray instance.", flush=True)
            sys.exit(1)
        print("======== Autoscaler status: stand-in ========")
        print("Node status")
        print("-" * 63)
        print("Active:")
        for n in range(count):
            print(f" 1 node_{n:056x}")
        print("Pending:")
        print(" (no pending nodes)")
        print("Recent failures:")
        print(" (no failures)")
    else:
        print(f"the ray stand-in does not do {args}", file=sys.stderr)
        sys.exit(2)
    """
    )
)

VLLM = (
    "#!{python}\n# A STAND-IN for vLLM over Ray (no GPU here): see tests/support/ray_stand_in.py.\n"
    + COMMON
    + textwrap.dedent(
        """\
    if sys.argv[1:] == ["--version"]:
        print("0.0.0 (a stand-in for vLLM)")
        sys.exit(0)
    if "--distributed-executor-backend" in sys.argv:
        address = os.environ.get("RAY_ADDRESS", "")
        try:
            nodes = nodes_at(address) if address else 0
        except OSError:
            nodes = 0
        record("serve", ray_address=address, ray_nodes=nodes)
    recording = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm-recording")
    os.execv(sys.executable, [sys.executable, recording, *sys.argv[1:]])
    """
    )
)


def install(bin_dir: Path) -> None:
    """`ray` and `vllm` stand-ins in bin_dir, for a PATH."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    scripts = {
        "ray": RAY.replace("{python}", sys.executable),
        "vllm": VLLM.replace("{python}", sys.executable),
        "vllm-recording": STAND_IN.format(python=sys.executable),
    }
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)


def events(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
