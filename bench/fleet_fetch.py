#!/usr/bin/env python
"""Weights to a whole fleet (issue 24): one node, eight from the mirror only, eight with peers; and one node at 50 ms.

    sudo .venv/bin/python bench/fleet_fetch.py [--size-mib 1024] [--rate-mbit 400] [--nodes 8]
                                               [--rtt-ms 50] [--conn-mbit 40] [--rtt-size-mib 256]
                                               [--connections 8]

Nodes are network namespaces on one bridge (tests/netns.py, as in the fleet test); the
byte listener (gunicorn, sendfile, public: the pass is not what is measured) runs on
this host, on the bridge. Every link is shaped with `tc tbf` to the same rate
(--rate-mbit): the byte listener's host (the bridge's egress, which only traffic from
this host passes; node-to-node traffic is forwarded between the bridge's ports), and
each node's download (its veth's egress on the bridge side) and upload (its interface's
egress inside its namespace). The set is generated, not downloaded: four files of
--size-mib in all, random bytes, in the mirror as bench/v1; the mirror hashes it and
makes its v2 torrent (4 MiB pieces) before anything is timed.

Each node runs `contracts.swarm.Swarm` (libtorrent) in a process of its own inside its
namespace, the byte listener as its web seed. All nodes of a run are started and
waited on until their session is up, then told to go at once; a run's time is from
"go" to the last node's last verified piece, and a node keeps seeding until the run ends.

- one node alone: T1;
- N nodes at once, mirror only: no peer may connect (the engine's allow-list empty);
- N nodes at once with peers: each node is given the others' addresses (what the control
  plane hands an agent) and may connect to them only;
- the agent's own path: each node runs `python -m agent.peers` (the node's one libtorrent
  session, as `manage.py agent` starts it beside its worker: peers from the byte listener's
  tracker, enrolled nodes only) and `manage.py fetch` through it, against a second byte
  listener that serves only enrolled nodes (with Redis for the tracker); one node alone
  (T1 agent), then N at once; its times include each fetch command's start; each node's
  fetch opens --connections to the mirror (LLMGW_FETCH_CONNECTIONS) until a peer holds the set;
- bytes the byte listener's host sent on the bridge in each run (tx counter of the bridge);
- one node, one file of --rtt-size-mib, through a relay on this host that holds every
  chunk --rtt-ms/2 each way and limits each TCP connection to --conn-mbit (this kernel has
  no netem or fq: `tc` cannot delay or pace per flow here): curl's single stream, libtorrent
  with the mirror as its one web seed, and the agent's fetch (`agent.fetch.fetch_source`, what
  `manage.py fetch` runs: the manifest, the torrent, then the --connections URLs it offers).

Ratios are against the named figure of the same run. Root is needed (namespaces, tc).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import ROOT, Servers, table, until  # noqa: E402

sys.path.insert(0, str(ROOT))

from fleet_nodes import NAMES, Agents, agent_fetch_main, get, node_main, run_nodes, tbf, write_set  # noqa: E402

# --- the 50 ms case: a relay that delays and limits each connection ---------------------


def start_relay(listen: tuple[str, int], upstream: tuple[str, int], one_way_s: float, conn_bytes_s: float):
    """A TCP relay on this host: every chunk is held `one_way_s` in each direction, and each
    connection's bytes towards the client are paced to `conn_bytes_s`. In a thread of its own."""
    loop = asyncio.new_event_loop()

    async def pipe(reader, writer, pace: float | None):
        queue: asyncio.Queue = asyncio.Queue()

        async def send():
            budget_start, sent = time.monotonic(), 0
            while True:
                due, data = await queue.get()
                if data is None:
                    break
                delay = due - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                if pace:
                    sent += len(data)
                    ahead = sent / pace - (time.monotonic() - budget_start)
                    if ahead > 0:
                        await asyncio.sleep(ahead)
                writer.write(data)
                await writer.drain()
            writer.close()

        sender = asyncio.ensure_future(send())
        try:
            while data := await reader.read(64 << 10):
                await queue.put((time.monotonic() + one_way_s, data))
        except ConnectionError:
            pass
        await queue.put((0, None))
        try:
            await sender
        except ConnectionError:
            pass

    async def handle(client_reader, client_writer):
        try:
            up_reader, up_writer = await asyncio.open_connection(*upstream)
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(
            pipe(client_reader, up_writer, None), pipe(up_reader, client_writer, conn_bytes_s), return_exceptions=True
        )

    async def serve():
        server = await asyncio.start_server(handle, *listen)
        async with server:
            await server.serve_forever()

    thread = threading.Thread(target=lambda: loop.run_until_complete(serve()), daemon=True)
    thread.start()
    return loop


def one_node_at_rtt(host, work: Path, mirror: Path, fleet_address: str, bytes_port: int, args) -> dict:
    import socket

    with socket.socket() as s:
        s.bind((fleet_address, 0))
        relay_port = s.getsockname()[1]
    start_relay(
        (fleet_address, relay_port), (fleet_address, bytes_port), args.rtt_ms / 2000, args.conn_mbit * 1_000_000 / 8
    )
    relay = f"http://{fleet_address}:{relay_port}/"
    torrent = work / "one.torrent"
    get(f"{relay}bench/one/")
    torrent.write_bytes(get(f"{relay}bench/one/?torrent"))
    out = {}
    dest = work / "curl"
    dest.mkdir(exist_ok=True)
    started = time.monotonic()
    subprocess.run(host.argv(["curl", "-sf", "-o", str(dest / "one.bin"), f"{relay}bench/one/one.bin"]), check=True)
    out["curl"] = time.monotonic() - started
    shutil.rmtree(dest)
    # A single-file torrent: its web seed is the version's own address.
    result = run_nodes([host], work, torrent, f"{relay}bench/one/", False, "lo")
    out["libtorrent, the mirror as its one web seed"] = result["seconds"]
    # The agent's fetch, the relay as its byte listener: the URLs it offers are its own choice.
    cache = work / "agent-rtt"
    env = {
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", "/root"),
        "LLMGW_BYTES_URL": relay,
        "LLMGW_VAR": str(work / "agent-rtt-var"),
        "LLMGW_AGENT_CACHE": str(cache),
        "LLMGW_FETCH_CONNECTIONS": str(args.connections),
        "REDIS_URL": "redis://127.0.0.1:1/0",  # unused: no node name, so no progress in Redis and no tracker
    }
    argv = [sys.executable, str(Path(__file__).resolve()), "agent-fetch", "--source", f"{relay}bench/one/"]
    fetch = subprocess.Popen(
        host.argv([*argv, "--cache", str(cache)]),
        env=env,
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=open(work / "agent-rtt.log", "ab"),
        text=True,
    )
    if fetch.stdout.readline().strip() != "ready":
        raise SystemExit("the agent's fetch did not start; see agent-rtt.log")
    fetch.stdin.write("go\n")
    fetch.stdin.flush()
    line = fetch.stdout.readline().strip()
    fetch.wait(timeout=60)
    try:
        out[f"the agent's fetch ({args.connections} connections)"] = json.loads(line)["seconds"]
    except ValueError:
        raise SystemExit(f"the agent's fetch failed: {line!r}; see agent-rtt.log") from None
    shutil.rmtree(cache, ignore_errors=True)
    return out


def start_agents_side(fleet, hosts, servers: Servers, env: dict, args) -> Agents:
    """What the agent's path needs on this host: Redis (the tracker's peer lists), a byte listener that
    serves only enrolled nodes (the tracker names them), and each node enrolled."""
    import secrets
    import socket

    import requests

    def port_on_bridge() -> int:
        with socket.socket() as s:
            s.bind((fleet.address, 0))
            return s.getsockname()[1]

    redis_port, bytes_port = port_on_bridge(), port_on_bridge()
    password = secrets.token_hex(16)
    redis_url = f"redis://:{password}@{fleet.address}:{redis_port}/0"
    redis = ["redis-server", "--bind", fleet.address, "--port", str(redis_port), "--requirepass", password]
    servers.spawn(redis + ["--save", "", "--appendonly", "no"], "redis")
    private = dict(
        env, LLMGW_BYTES_PUBLIC="false", REDIS_URL=redis_url, LLMGW_BYTES_ADDR=f"{fleet.address}:{bytes_port}"
    )
    tokens = {}
    for index in range(1, len(hosts) + 1):
        made = subprocess.run(
            [sys.executable, "manage.py", "node_token", f"n{index}"],
            env=private,
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
        )
        tokens[f"n{index}"] = made.stdout.strip().splitlines()[-1]
    servers.spawn([sys.executable, "manage.py", "byte_listener"], "byte-listener-private", private)
    url = f"http://{fleet.address}:{bytes_port}/"

    def answers() -> bool:
        try:
            return requests.get(url, timeout=2).status_code == 401
        except requests.RequestException:
            return False

    until(answers, 60, "the byte listener for the agents (see byte-listener-private.log)", 0.3)
    return Agents(hosts, servers.work, url, redis_url, tokens, args.connections)


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="role")
    node = sub.add_parser("node")
    for option in ("--torrent", "--dest", "--seed", "--listen"):
        node.add_argument(option, required=True)
    node.add_argument("--peers", default="")
    agent_fetch = sub.add_parser("agent-fetch")
    agent_fetch.add_argument("--source", required=True)
    agent_fetch.add_argument("--cache", required=True)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--rate-mbit", type=int, default=400, help="every link's rate (400 Mbit/s = 50 MB/s)")
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--rtt-ms", type=int, default=50)
    parser.add_argument("--conn-mbit", type=int, default=40, help="each connection's limit in the RTT case")
    parser.add_argument("--rtt-size-mib", type=int, default=256)
    parser.add_argument(
        "--connections", type=int, default=8, help="LLMGW_FETCH_CONNECTIONS of the agent's fetches (its rows only)"
    )
    parser.add_argument("--skip", default="", help="comma-separated: t1, mirror, peers, agents, rtt")
    args = parser.parse_args()
    if args.role == "node":
        return node_main(args)
    if args.role == "agent-fetch":
        return agent_fetch_main(args)
    if os.geteuid() != 0 or shutil.which("tc") is None:
        raise SystemExit("bench/fleet_fetch.py needs root and tc (iproute2): nodes are namespaces, links are shaped")

    from tests.netns import Fleet

    fleet = Fleet()
    try:
        with Servers("llmgw-bench-fleet-fetch-") as servers:
            os.chmod(servers.work, 0o755)
            run_all(args, fleet, servers)
    finally:
        fleet.remove()


def serve_the_set(args, fleet, servers: Servers, total: int) -> tuple[dict, int, Path]:
    """The byte listener on the bridge, public, the set hashed and its torrent made: (its environment,
    its port, the torrent)."""
    import socket

    work = servers.work
    with socket.socket() as s:
        s.bind((fleet.address, 0))
        bytes_port = s.getsockname()[1]
    env = dict(
        os.environ,
        DJANGO_SETTINGS_MODULE="llmgw_site.settings",
        LLMGW_MIRROR_ROOT=str(work / "mirror"),
        LLMGW_BYTES_ADDR=f"{fleet.address}:{bytes_port}",
        LLMGW_VAR=str(work / "var"),
        DATABASE_URL=f"sqlite:///{work / 'bench.sqlite3'}",
        LLMGW_BYTES_PUBLIC="true",
        LLMGW_MIRROR_HASH_INLINE_BYTES=str(max(args.size_mib, args.rtt_size_mib) << 21),
    )
    subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], env=env, cwd=ROOT, check=True)
    servers.spawn([sys.executable, "manage.py", "byte_listener"], "byte-listener", env)
    base = f"http://{fleet.address}:{bytes_port}/"
    print(f"hashing {total / (1 << 30):.2f} GiB and making its torrent …", flush=True)
    get(f"{base}bench/v1/")
    torrent = work / "v1.torrent"
    torrent.write_bytes(get(f"{base}bench/v1/?torrent"))
    return env, bytes_port, torrent


def run_all(args, fleet, servers: Servers) -> None:
    """The set served on the bridge and hashed, every link shaped, then each run the options leave in."""
    skip = set(filter(None, args.skip.split(",")))
    work = servers.work
    mirror = work / "mirror"
    total = write_set(mirror / "bench" / "v1", NAMES, args.size_mib)
    if "rtt" not in skip:
        write_set(mirror / "bench" / "one", ["one.bin"], args.rtt_size_mib)
    hosts = [fleet.add_host(f"n{i}") for i in range(1, args.nodes + 1)]
    env, bytes_port, torrent = serve_the_set(args, fleet, servers, total)
    base = f"http://{fleet.address}:{bytes_port}/"

    # Every link at the same rate: the mirror host's uplink, each node's down- and uplink.
    tbf(fleet.bridge, args.rate_mbit)
    for index, host in enumerate(hosts, 1):
        tbf(host.veth, args.rate_mbit)
        tbf(f"lg{fleet.tag}n{index}", args.rate_mbit, namespace=host.name)  # the node's end (tests/netns.py)
    seed = f"{base}bench/"  # a folder torrent: libtorrent adds v1/<file>
    runs = {
        "t1": ("one node alone (T1)", lambda: run_nodes(hosts[:1], work, torrent, seed, False, fleet.bridge)),
        "mirror": (
            f"{args.nodes} nodes, mirror only",
            lambda: run_nodes(hosts, work, torrent, seed, False, fleet.bridge),
        ),
        "peers": (f"{args.nodes} nodes, with peers", lambda: run_nodes(hosts, work, torrent, seed, True, fleet.bridge)),
    }
    rows = {}
    for key, (name, run) in runs.items():
        if key not in skip:
            rows[name] = run()
            print(name, rows[name], flush=True)
    if "agents" not in skip:
        agents = start_agents_side(fleet, hosts, servers, env, args)
        for count, name in (
            (1, AGENT_T1),
            (len(hosts), f"{args.nodes} nodes, the agent's path (peers from the tracker)"),
        ):
            rows[name] = agents.run(count, fleet.bridge)
            print(name, rows[name], flush=True)
    rtt = None
    if "rtt" not in skip:
        rtt = one_node_at_rtt(hosts[0], work, mirror, fleet.address, bytes_port, args)
        print("rtt", rtt, flush=True)
    print_tables(args, total, rows, rtt)


AGENT_T1 = "one node alone, the agent's path (T1 agent)"


def print_tables(args, total: int, rows: dict, rtt: dict | None) -> None:
    print(
        f"\n{len(NAMES)} files, {total / (1 << 30):.2f} GiB; every link {args.rate_mbit} Mbit/s "
        f"({args.rate_mbit / 8:.0f} MB/s); {args.nodes} nodes\n"
    )
    t1 = rows.get("one node alone (T1)", {}).get("seconds")
    t1_agent = rows.get(AGENT_T1, {}).get("seconds")

    def gib(value) -> str:
        return "—" if value is None else f"{value / (1 << 30):.2f} GiB"

    def against(name: str, row: dict) -> str:
        reference, label = (t1_agent, "T1 agent") if "agent's path" in name else (t1, "T1")
        return f"{row['seconds'] / reference:.2f} × {label}" if reference else "—"

    table(
        ["run", "time", "vs T1", "the byte listener's host sent", "vs the set", "from peers", "from the mirror"],
        [
            (name, f"{row['seconds']:.1f} s", against(name, row), gib(row["mirror_sent"]))
            + (f"{row['mirror_sent'] / total:.2f} ×", gib(row["from_peers"]), gib(row["from_web"]))
            for name, row in rows.items()
        ],
    )
    if rtt:
        print(
            f"\none node, one file of {args.rtt_size_mib} MiB, {args.rtt_ms} ms round trip, "
            f"{args.conn_mbit} Mbit/s a connection\n"
        )
        size = args.rtt_size_mib << 20
        table(
            ["how", "time", "throughput", "vs curl"],
            [  # curl first
                (name, f"{rtt[name]:.1f} s", f"{size / rtt[name] / 1e6:.1f} MB/s", f"{rtt['curl'] / rtt[name]:.2f} ×")
                for name in rtt
            ],
        )


if __name__ == "__main__":
    main()
