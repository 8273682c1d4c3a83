#!/usr/bin/env python
"""One replica across nodes (issue 37): the demo model on one node against the same model across two and three.

    .venv/bin/python bench/spread.py [--quick] [--rounds 4] [--max-tokens 64] [--slots 4]

Needs root (network namespaces), stunnel, and `make engine`'s rpc-server and llama-server with
the RPC backend. The head is this host; each worker is a network namespace of its own on a bridge
made for this run (tests/netns.py), running llama.cpp's rpc-server on its loopback behind stunnel
with its pre-shared key, as the agent runs a worker (agent/rpc_group.py `Workers`, stepped by a
small loop inside the namespace). The head's supervisor (agent/supervisor.py) starts llama-server
with `--rpc` through its own stunnel clients, exactly as a node's agent does for a group's order.

Per configuration (one node, two, three, and the model no single node can hold):
- load time: from the workers' order to the head answering (workers started first, as the
  control plane orders them), and again at a restart (head and workers stopped, started anew;
  rpc-server's tensor cache `-c` kept on the worker's disk);
- bytes sent from the head to its workers (the host's ends of the workers' veth pairs, so TLS
  and TCP included) at the first start and at the restart;
- tokens per second and first token (p50) at 1 and at 4 clients, each client streaming
  --rounds answers of --max-tokens tokens at temperature 0;
- whether the answer at temperature 0 is token for token the one node's.

"No single node can hold it": placement itself (fleet.placement.place) is given three nodes
that report too little memory for the profile alone, and the split it chooses is what is run.

Printed: one table, the load average before and after each row, and ratio lines against one
node measured in the same run. Traffic goes only to loopback and the namespaces this run made.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests
from harness import ROOT, table

sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")

from agent import engine_state, engines, rpc_group, supervisor  # noqa: E402
from contracts import groups, signing  # noqa: E402

HEAD_TOKEN = "llmgw-bench-spread-head"
NONCE = "1700000000000042"
PROMPT = "Once upon a time, in a small village by the sea,"
# Each start of the same group is the same replica id, so a restart finds its tensor cache; configurations differ.
ALONE, TWO, THREE, TOO_BIG = 1, 2, 3, 4


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def worker_node(cache: str, listen: str, token: str) -> int:
    """Inside a worker's namespace: its agent's RPC worker loop, until this process is killed."""
    workers = rpc_group.Workers(Path(cache), lambda *a, **k: None, signing.token_hash(token), listen=listen)
    while True:
        workers.step()
        time.sleep(0.2)


class Worker:
    """A worker node: a namespace, its own cache and token, and the loop that runs its rpc-server."""

    def __init__(self, fleet, name: str, work: Path):
        self.name = name
        self.host = fleet.add_host(name)
        self.cache = work / name
        self.cache.mkdir()
        self.token = f"llmgw-bench-spread-{name}"
        self.port = 7400
        argv = [sys.executable, __file__, "--worker-node", str(self.cache), self.host.address, self.token]
        self.loop = subprocess.Popen(
            self.host.argv(argv), stdout=subprocess.DEVNULL, stderr=open(work / f"{name}.log", "w")
        )

    def entry(self, replica_id: int) -> dict:
        path = rpc_group.Workers.wants_path(self.cache)
        return json.loads(path.read_text()).get(str(replica_id), {}) if path.exists() else {}

    def order(self, replica_id: int, share: float) -> groups.GroupWorker:
        psk = groups.rpc_psk(signing.token_hash(self.token), replica_id, NONCE)
        return groups.GroupWorker(
            node=self.name,
            endpoint=f"{self.host.address}:{self.port}",
            sealed_psk=groups.seal_psk(signing.token_hash(HEAD_TOKEN), psk, replica_id, NONCE, self.name),
            share=share,
        )

    def sent_to(self) -> int:
        """Bytes the host has sent into this namespace (the host's end of its veth)."""
        return int(Path(f"/sys/class/net/{self.host.veth}/statistics/tx_bytes").read_text())


def until(condition, what: str, timeout: float = 300, step=None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"gave up waiting for {what} after {timeout:.0f} s")
        if step is not None:
            step()
        time.sleep(0.1)


class Run:
    """The head's supervisor on this host, the worker namespaces, and the model's weights."""

    def __init__(self, work: Path, options, fleet):
        from launcher import smollm2

        self.work, self.options, self.fleet = work, options, fleet
        self.weights = work / "weights"
        self.weights.mkdir()
        (self.weights / smollm2.FILE).symlink_to(smollm2.gguf_path())
        self.model = smollm2.MODEL
        self.head = supervisor.Supervisor(work / "head", lambda *a, **k: None, token=HEAD_TOKEN, backoff_max=2)
        self.workers = [Worker(fleet, f"w{n}", work) for n in (1, 2)]
        self.args = ["--parallel", str(options.slots), "--ctx-size", str(options.slots * 1024), "--threads", "1"]

    def entry(self, replica_id: int) -> dict:
        return engine_state.read_state(self.head.cache)["replicas"].get(str(replica_id), {})

    def start(self, replica_id: int, head_share: float, shares: list[tuple[Worker, float]]) -> tuple[float, int]:
        """Workers first, then the head; (seconds until the head answers, bytes sent to the workers)."""
        before = sum(w.sent_to() for w, _ in shares)
        started = time.monotonic()
        for worker, _ in shares:
            rpc_group.Workers.want(worker.cache, replica_id, worker.port, NONCE, "head")
        for worker, _ in shares:
            until(lambda w=worker: w.entry(replica_id).get("ready"), f"worker {worker.name} to be ready")
        order = None
        if shares:
            order = groups.GroupOrder(head_share=head_share, workers=[w.order(replica_id, s) for w, s in shares])
        engine_state.want(
            self.head.cache, replica_id, "llamacpp", "bench", self.weights, self.args, self.model, NONCE, order
        )
        until(lambda: self.entry(replica_id).get("ready"), "the head to answer", step=self.head.step)
        return time.monotonic() - started, sum(w.sent_to() for w, _ in shares) - before

    def stop(self, replica_id: int, shares: list[tuple[Worker, float]]) -> None:
        if engine_state.unwant(self.head.cache, replica_id):
            until(lambda: not self.entry(replica_id), "the head's engine to stop", step=self.head.step)
        for worker, _ in shares:
            if rpc_group.Workers.unwant(worker.cache, replica_id):
                until(lambda w=worker: not w.entry(replica_id), f"worker {worker.name} to stop")

    def url_and_secret(self, replica_id: int) -> tuple[str, str]:
        entry = self.entry(replica_id)
        return f"http://127.0.0.1:{entry['port']}/completion", self.head.secret(entry)

    def close(self) -> None:
        for replica_id in (ALONE, TWO, THREE, TOO_BIG):
            engine_state.unwant(self.head.cache, replica_id)
        self.head.step()
        for entry in engine_state.read_state(self.head.cache)["replicas"].values():
            if entry.get("pid"):
                engines.stop_group(entry["pid"], grace=2)
            rpc_group.Tunnels.stop(entry.get("tunnels", {}).get("pids", []))
        for worker in self.workers:
            worker.loop.kill()


def stream(url: str, secret: str, max_tokens: int) -> tuple[float, int, str]:
    """One answer streamed: (seconds to its first token, tokens, the tokens' ids or text, to compare)."""
    body = {
        "prompt": PROMPT,
        "n_predict": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_tokens": True,
        "cache_prompt": False,
    }
    started, first, said, chunks, predicted = time.monotonic(), None, [], 0, None
    headers = {"Authorization": f"Bearer {secret}"}
    with requests.post(url, json=body, headers=headers, stream=True, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines(decode_unicode=True):
            if not line.startswith("data: "):
                continue
            chunk = json.loads(line[len("data: ") :])
            if chunk.get("stop"):
                predicted = chunk.get("timings", {}).get("predicted_n")
                continue
            first = first if first is not None else time.monotonic() - started
            chunks += 1
            said.append(str(chunk.get("tokens") or chunk.get("content", "")))
    return first or 0.0, predicted or chunks, "|".join(said)


def play(url: str, secret: str, clients: int, rounds: int, max_tokens: int) -> tuple[float, float]:
    """`clients` at once, each streaming `rounds` answers: (tokens per second, first token p50 in ms)."""
    firsts: list[float] = []
    tokens = [0]
    lock = threading.Lock()

    def client() -> None:
        for _ in range(rounds):
            first, n, _ = stream(url, secret, max_tokens)
            with lock:
                firsts.append(first)
                tokens[0] += n

    started = time.monotonic()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return tokens[0] / (time.monotonic() - started), statistics.median(firsts) * 1000


def too_big_split() -> tuple[float, list[float]]:
    """Placement's own choice for a profile no node can hold alone: (the head's share, the workers')."""
    from fleet.placement import ModelView, NodeView, ProfileView, place

    nodes = [
        NodeView("head", memory_gb=2, engines=frozenset({"llamacpp"}), rpc=True, rpc_head=True),
        NodeView("w1", memory_gb=1, engines=frozenset({"llamacpp"}), rpc=True),
        NodeView("w2", memory_gb=1, engines=frozenset({"llamacpp"}), rpc=True),
    ]
    alone = ModelView("too-big", "bench", 1, (ProfileView("cpu", "llamacpp", min_memory_gb=3),))
    (unplaced,) = place(nodes, [alone], []).unplaced
    spread = ModelView("too-big", "bench", 1, (ProfileView("cpu", "llamacpp", min_memory_gb=3, nodes=2),))
    (assignment,) = place(nodes, [spread], []).assign
    print(f"on one node: {unplaced.reason}\nwith nodes=2: {assignment.explanation}", flush=True)
    return assignment.head_share, [s.share for s in assignment.shares]


def measure(run: Run, label: str, replica_id: int, head_share: float, shares, alone_ids) -> dict:
    """One configuration: start, answer at 1 and 4 clients, restart; its row."""
    o = run.options
    row = {"label": label, "before": load_average()}
    row["load_s"], row["sent"] = run.start(replica_id, head_share, shares)
    url, secret = run.url_and_secret(replica_id)
    _, _, ids = stream(url, secret, o.max_tokens)
    row["same"] = "—" if alone_ids is None else ("yes" if ids == alone_ids else "NO")
    row["ids"] = ids
    row["tps1"], row["ttft1"] = play(url, secret, 1, o.rounds, o.max_tokens)
    row["tps4"], row["ttft4"] = play(url, secret, 4, o.rounds, o.max_tokens)
    run.stop(replica_id, shares)
    row["reload_s"], row["resent"] = run.start(replica_id, head_share, shares)
    run.stop(replica_id, shares)
    row["after"] = load_average()
    print(f"{label}: {json.dumps({k: v for k, v in row.items() if k != 'ids'})}", flush=True)
    return row


def megabytes(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def print_rows(rows: list[dict], options) -> None:
    print(
        f"\n{rows[0]['label']} vs across nodes: llama-server --parallel {options.slots} --threads 1 on the head, "
        f"rpc-server on each worker; {options.rounds} answers of {options.max_tokens} tokens per client\n"
    )
    table(
        ["replica", "load", "load at restart", "sent to workers", "at restart", "tokens/s, 1 client"]
        + ["first token p50", "tokens/s, 4 clients", "first token p50", "same tokens as one node"]
        + ["load average (before → after)"],
        [
            (r["label"], f"{r['load_s']:.1f} s", f"{r['reload_s']:.1f} s", megabytes(r["sent"]), megabytes(r["resent"]))
            + (f"{r['tps1']:.1f}", f"{r['ttft1']:.0f} ms", f"{r['tps4']:.1f}", f"{r['ttft4']:.0f} ms", r["same"])
            + (f"{r['before']} → {r['after']}",)
            for r in rows
        ],
    )
    peer = rows[0]
    print()
    for r in rows[1:]:
        print(
            f"{r['label']} against {peer['label']}: tokens/s {r['tps1'] / peer['tps1']:.2f}× at 1 client, "
            f"{r['tps4'] / peer['tps4']:.2f}× at 4; first token {r['ttft1'] / peer['ttft1']:.2f}× at 1, "
            f"{r['ttft4'] / peer['ttft4']:.2f}× at 4; load {r['load_s'] / peer['load_s']:.2f}×; "
            f"a restart sent {r['resent'] / max(r['sent'], 1):.0%} of the first start's bytes",
            flush=True,
        )


def main() -> int:
    if sys.argv[1:2] == ["--worker-node"]:
        return worker_node(*sys.argv[2:5])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--quick", action="store_true", help="1 answer of 16 tokens per client")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--slots", type=int, default=4)
    options = parser.parse_args()
    if options.quick:
        options.rounds, options.max_tokens = 1, 16
    import django

    django.setup()
    from tests import netns

    if reason := netns.unavailable():
        raise SystemExit(reason)
    if not (rpc_group.stunnel() and rpc_group.rpc_server() and rpc_group.can_be_head()):
        raise SystemExit("stunnel, rpc-server or a llama-server built with RPC is missing: run `make engine`")
    work = Path(tempfile.mkdtemp(prefix="llmgw-bench-spread-"))
    fleet = netns.Fleet()
    run = None
    try:
        run = Run(work, options, fleet)
        w1, w2 = run.workers
        head_share, (share,) = too_big_split()
        rows = [measure(run, "one node", ALONE, 1.0, [], None)]
        alone_ids = rows[0]["ids"]
        rows.append(measure(run, "two nodes", TWO, 0.5, [(w1, 1.0)], alone_ids))
        rows.append(measure(run, "three nodes", THREE, 1 / 3, [(w1, 0.5), (w2, 0.5)], alone_ids))
        label = f"too big for one node: two, {head_share:.0%} on the head"
        rows.append(measure(run, label, TOO_BIG, head_share, [(w1, share)], alone_ids))
        print_rows(rows, options)
    finally:
        if run is not None:
            run.close()
        fleet.remove()
    print(f"\nlogs under {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
