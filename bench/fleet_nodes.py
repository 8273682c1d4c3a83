"""What bench/fleet_fetch.py runs inside a node's namespace (a libtorrent session, the agent's fetch)
and on this host to start nodes, shape their links and count what they sent."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from harness import ROOT

# The script a node runs, in its namespace: bench/fleet_fetch.py `node` or `agent-fetch`.
SCRIPT = Path(__file__).resolve().parent / "fleet_fetch.py"

PEER_PORT = 6881
NAMES = [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]


# --- inside a node's namespace ---------------------------------------------------------


def node_main(args) -> None:
    """One node: set up the session, say "ready", fetch at "go", say what it got, seed until stdin closes."""
    from contracts.swarm import Swarm

    torrent = Path(args.torrent).read_bytes()
    peers = [(p, PEER_PORT) for p in args.peers.split(",") if p]
    swarm = Swarm(listen_port=PEER_PORT, listen_host=args.listen)
    swarm.allow(p for p, _ in peers)
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    started = time.monotonic()
    done = swarm.fetch(torrent, args.dest, web_seeds=args.seed.split(","), peers=peers, stall_s=60)
    print(
        json.dumps(
            {
                "seconds": time.monotonic() - started,
                "from_peers": done.bytes_from_peers,
                "from_web": done.bytes_from_web_seeds,
                "bytes": done.bytes_total,
            }
        ),
        flush=True,
    )
    sys.stdin.read()  # seeding for the others until the run ends
    swarm.close()


def agent_fetch_main(args) -> None:
    """One node's fetch as `manage.py fetch` makes it (the node's settings, `fetch_source`): "ready", then at "go"
    the source into the cache, and its seconds."""
    os.environ["DJANGO_SETTINGS_MODULE"] = "agent.settings"
    import django

    django.setup()
    from agent.fetch import fetch_source

    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    started = time.monotonic()
    fetch_source(args.source, Path(args.cache))
    print(json.dumps({"seconds": time.monotonic() - started}), flush=True)


# --- on this host ----------------------------------------------------------------------


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


def tbf(device: str, mbit: int, namespace: str | None = None) -> None:
    burst = max(64 << 10, mbit * 1_000_000 // 8 // 100)  # at least a 10 ms tick of bytes
    prefix = ["ip", "netns", "exec", namespace] if namespace else []
    sh(
        *prefix,
        "tc",
        "qdisc",
        "replace",
        "dev",
        device,
        "root",
        "tbf",
        "rate",
        f"{mbit}mbit",
        "burst",
        str(burst),
        "latency",
        "200ms",
    )


def tx_bytes(device: str) -> int:
    return int(Path(f"/sys/class/net/{device}/statistics/tx_bytes").read_text())


def write_set(directory: Path, names: list[str], total_mib: int) -> int:
    directory.mkdir(parents=True)
    each = (total_mib << 20) // len(names)
    for name in names:
        with open(directory / name, "wb") as fh:
            left = each
            while left:
                chunk = os.urandom(min(left, 8 << 20))
                fh.write(chunk)
                left -= len(chunk)
    then = time.time_ns() - 3600 * 10**9  # copied in an hour ago: settled
    for name in names:
        os.utime(directory / name, ns=(then, then))
    return each * len(names)


def get(url: str, timeout: float = 600) -> bytes:
    """The body once the mirror answers 200 (it answers 503 while it hashes and makes the torrent)."""
    import requests

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            answer = requests.get(url, timeout=600)
        except requests.RequestException:
            time.sleep(0.5)
            continue
        if answer.status_code == 200 and (not url.endswith("/") or "torrent" in answer.json()):
            return answer.content
        time.sleep(1)
    raise SystemExit(f"{url} did not answer 200 within {timeout:g} s")


class Node:
    def __init__(self, host, work: Path, torrent: Path, seed: str, peers: list[str]):
        self.host = host
        self.dest = work / "nodes" / host.name.rsplit("-", 1)[1]
        shutil.rmtree(self.dest, ignore_errors=True)
        argv = [
            sys.executable,
            str(SCRIPT),
            "node",
            "--torrent",
            str(torrent),
            "--dest",
            str(self.dest),
            "--seed",
            seed,
            "--listen",
            host.address,
            "--peers",
            ",".join(peers),
        ]
        self.log = open(work / f"{host.name}.log", "ab")
        self.process = subprocess.Popen(
            host.argv(argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            start_new_session=True,
        )
        self.result: dict | None = None

    def wait_ready(self) -> None:
        line = self.process.stdout.readline().strip()
        if line != "ready":
            raise SystemExit(f"node {self.host.name} did not start: {line!r}; see its log")

    def go(self) -> None:
        self.process.stdin.write("go\n")
        self.process.stdin.flush()

    def wait_done(self) -> dict:
        line = self.process.stdout.readline().strip()
        try:
            self.result = json.loads(line)
        except ValueError:
            raise SystemExit(f"node {self.host.name} failed: {line!r}; see its log") from None
        return self.result

    def stop(self) -> None:
        try:
            self.process.stdin.close()
        except OSError:
            pass
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.log.close()
        shutil.rmtree(self.dest, ignore_errors=True)


def run_nodes(hosts, work: Path, torrent: Path, seed: str, with_peers: bool, bridge: str) -> dict:
    """Start a node in each host, wait until all are up, say go, and time the last one's last piece."""
    nodes = []
    try:
        for host in hosts:
            peers = [h.address for h in hosts if h is not host] if with_peers else []
            nodes.append(Node(host, work, torrent, seed, peers))
        for node in nodes:
            node.wait_ready()
        sent_before = tx_bytes(bridge)
        started = time.monotonic()
        for node in nodes:
            node.go()
        results = []
        done_at = []
        threads = []

        def wait(node):
            results.append(node.wait_done())
            done_at.append(time.monotonic() - started)

        for node in nodes:
            threads.append(threading.Thread(target=wait, args=(node,)))
            threads[-1].start()
        for thread in threads:
            thread.join()
        seconds = max(done_at)
        sent = tx_bytes(bridge) - sent_before
        for node in nodes:
            got = sum(p.stat().st_size for p in node.dest.rglob("*") if p.is_file())
            if got != node.result["bytes"]:
                raise SystemExit(f"node {node.host.name} holds {got} bytes, not {node.result['bytes']}")
    finally:
        for node in nodes:
            node.stop()
    return {
        "seconds": seconds,
        "mirror_sent": sent,
        "from_peers": sum(r["from_peers"] for r in results),
        "from_web": sum(r["from_web"] for r in results),
        "slowest_node": max(r["seconds"] for r in results),
        "fastest_node": min(r["seconds"] for r in results),
    }


# --- the agent's own path: its libtorrent session process, peers from the byte listener's tracker ---


class Agents:
    """Each node as `manage.py agent` runs its fetches: `python -m agent.peers` (the node's one session,
    announcing to the byte listener's tracker, seeding what it holds) and `manage.py fetch` through it."""

    def __init__(self, hosts, work: Path, bytes_url: str, redis_url: str, tokens: dict[str, str], connections: int):
        self.hosts, self.work, self.bytes_url = hosts, work, bytes_url
        self.connections = connections
        self.redis_url, self.tokens = redis_url, tokens
        self.sessions: list[subprocess.Popen] = []

    def env(self, index: int, host) -> dict:
        cache = self.work / "agents" / f"n{index}"
        return {
            "PATH": os.environ["PATH"],
            "HOME": os.environ.get("HOME", "/root"),
            "PYTHONUNBUFFERED": "1",
            "LLMGW_NODE_NAME": f"n{index}",
            "LLMGW_NODE_TOKEN": self.tokens[f"n{index}"],
            "REDIS_URL": self.redis_url,
            "LLMGW_BYTES_URL": self.bytes_url,
            "LLMGW_VAR": str(self.work / "agents" / f"var-n{index}"),
            "LLMGW_AGENT_CACHE": str(cache),
            "LLMGW_ENGINE_ADVERTISE": host.address,
            "LLMGW_PEER_PORT": str(PEER_PORT),
            "LLMGW_FETCH_CONNECTIONS": str(self.connections),
        }

    def run(self, count: int, bridge: str) -> dict:
        hosts = self.hosts[:count]
        shutil.rmtree(self.work / "agents", ignore_errors=True)
        logs = []
        try:
            for index, host in enumerate(hosts, 1):
                env = self.env(index, host)
                log = open(self.work / f"agent-n{index}.log", "ab")
                logs.append(log)
                argv = [sys.executable, "-m", "agent.peers", "--cache", env["LLMGW_AGENT_CACHE"]]
                self.sessions.append(
                    subprocess.Popen(host.argv(argv), env=env, cwd=ROOT, stdout=log, stderr=log, start_new_session=True)
                )
            for index, _ in enumerate(hosts, 1):
                sock = self.work / "agents" / f"n{index}"
                until = time.monotonic() + 60
                while not list(sock.rglob("session.sock")):
                    if time.monotonic() > until:
                        raise SystemExit(f"node n{index}'s session did not start; see agent-n{index}.log")
                    time.sleep(0.2)
            sent_before = tx_bytes(bridge)
            started = time.monotonic()
            fetches = [
                subprocess.Popen(
                    host.argv([sys.executable, "manage.py", "fetch", "--quiet", f"{self.bytes_url}bench/v1/"]),
                    env=self.env(index, host),
                    cwd=ROOT,
                    stdout=subprocess.PIPE,
                    stderr=logs[index - 1],
                    text=True,
                )
                for index, host in enumerate(hosts, 1)
            ]
            times = []
            for index, fetch in enumerate(fetches, 1):
                out, _ = fetch.communicate(timeout=3600)
                times.append(time.monotonic() - started)
                if fetch.returncode != 0 or not (Path(out.strip()) / ".complete").exists():
                    raise SystemExit(f"node n{index}'s fetch failed; see agent-n{index}.log")
            seconds = max(times)
            sent = tx_bytes(bridge) - sent_before
        finally:
            for session in self.sessions:
                os.killpg(session.pid, signal.SIGTERM)
                try:
                    session.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(session.pid, signal.SIGKILL)
                    session.wait()
            self.sessions = []
            for log in logs:
                log.close()
            shutil.rmtree(self.work / "agents", ignore_errors=True)
        return {"seconds": seconds, "mirror_sent": sent, "from_peers": None, "from_web": None}
