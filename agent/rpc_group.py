"""One replica across several nodes (issue 37, contracts/groups.py): the node's half.

A worker runs llama.cpp's `rpc-server` for its share of the layers. rpc-server has no
authentication at all (whoever reaches its port may read and write its memory), so it
listens on 127.0.0.1 only, and stunnel, as a TLS-PSK server on the node's enrolled address,
carries the head's connections to it: only a holder of the replica's key gets through.
The head runs one stunnel client per worker on its own loopback and points llama-server's
`--rpc` at those.

The key: a worker derives it from its own token hash (`groups.rpc_psk`); the head opens
the sealed copy the control plane sent it (`groups.open_psk`). It is written only into
stunnel's PSK file, 0600 under the node's state directory, removed with the replica.

rpc-server keeps the tensors it was sent in its cache (`-c`, under the state directory,
kept across restarts): a group started again sends no tensor twice.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from contracts import groups

from . import engine_binary, engine_state, engines, ray_group

RPC_SERVER_SETTING = "LLMGW_RPC_SERVER"
TUNNEL_START_S = 10.0
STUNNEL_SETTING = "LLMGW_STUNNEL"


def rpc_server(which: Callable[[str], str | None] = shutil.which) -> str | None:
    """The rpc-server this node runs: LLMGW_RPC_SERVER, on PATH, or beside the interpreter (`make engine`)."""
    if configured := os.environ.get(RPC_SERVER_SETTING, "").strip():
        return configured if os.access(configured, os.X_OK) else None
    if found := which("rpc-server"):
        return found
    beside = Path(sys.executable).parent / "rpc-server"
    return str(beside) if os.access(beside, os.X_OK) else None


def stunnel(which: Callable[[str], str | None] = shutil.which) -> str | None:
    """Debian's stunnel4 (or LLMGW_STUNNEL)."""
    if configured := os.environ.get(STUNNEL_SETTING, "").strip():
        return configured if os.access(configured, os.X_OK) else None
    return which("stunnel4") or which("stunnel")


def _runs(argv: list[str], expect: str) -> bool:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=20, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return expect in done.stdout + done.stderr


def can_be_worker() -> bool:
    """rpc-server and stunnel are here and run (probed, not assumed): this node can hold a group's share."""
    server, tunnel = rpc_server(), stunnel()
    return bool(server and tunnel and _runs([server, "--help"], "--cache") and _runs([tunnel, "-version"], "stunnel"))


def can_be_head() -> bool:
    """The node's llama-server was built with the RPC backend (it takes `--rpc`), and stunnel runs."""
    server, tunnel = engine_binary.llama_server(), stunnel()
    return bool(server and tunnel and _runs([server, "--help"], "--rpc") and _runs([tunnel, "-version"], "stunnel"))


# --- files ------------------------------------------------------------------------------


def group_dir(cache: Path, replica_id: int) -> Path:
    return engine_state.state_dir(cache) / "rpc" / f"replica-{int(replica_id)}"


def tensor_cache(cache: Path) -> Path:
    """rpc-server's tensor cache (LLAMA_CACHE; it writes under `rpc/`): one per node, kept across restarts.

    Its files are named by the hash of their contents, so replicas of the same weights share them.
    """
    return engine_state.state_dir(cache) / "rpc-cache"


def write_private(path: Path, text: str) -> Path:
    """Written 0600 from the first byte: a PSK file or a config naming one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(text)
    return path


def stunnel_config(*, accept: str, connect: str, psk_file: Path, identity: str, client: bool) -> str:
    """One stunnel service: TLS 1.2 with a pre-shared key and nothing else (no certificate to keep).

    debug 5 makes stunnel log each connection's bytes at its close (what the tests count).
    """
    lines = [
        "foreground = yes",
        "debug = 5",
        "syslog = no",
        "[rpc]",
        f"client = {'yes' if client else 'no'}",
        f"accept = {accept}",
        f"connect = {connect}",
        "sslVersion = TLSv1.2",
        "ciphers = PSK",
        f"PSKsecrets = {psk_file}",
    ]
    if client:
        lines.append(f"PSKidentity = {identity}")
    # A worker cut off by the network is given up on in about 11 s, not TCP's two hours.
    side = "r" if client else "a"
    for option in ("SO_KEEPALIVE=1", "TCP_KEEPIDLE=5", "TCP_KEEPINTVL=2", "TCP_KEEPCNT=3"):
        lines.append(f"socket = {side}:{option}")
    return "\n".join(lines) + "\n"


def answers_tcp(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _listening(pid: int, port: int) -> bool:
    try:
        return any(
            c.status == psutil.CONN_LISTEN and c.laddr.port == port
            for c in psutil.Process(pid).net_connections(kind="tcp")
        )
    except psutil.Error:
        return False


def _alive(process: subprocess.Popen | None, pid: int | None) -> bool:
    if process is not None:
        return process.poll() is None
    return bool(pid) and engines.group_alive(pid)


# --- a worker ---------------------------------------------------------------------------


class Workers:
    """The RPC workers this node runs, kept by the supervisor beside its engines.

    The task (START_RPC_WORKER) writes what is wanted into `rpc/workers.json`; each step
    starts what is wanted and not running, stops what is running and no longer wanted, and
    reports a worker whose rpc-server or stunnel died, naming which. A vLLM group's worker
    (engine "vllm", contracts/ray.py) is a `ray start` joining the head's Ray instead
    (agent/ray_group.py), kept the same way.
    """

    def __init__(self, cache: Path, report, key: str, *, listen: str, user: tuple[int, int] | None = None):
        self.cache = Path(cache)
        self.report = report  # agent.replica_reports' Report, called with role="worker"
        self.key = key  # the node's token hash: its PSKs are made from it
        self.listen = listen  # the enrolled address stunnel listens on
        self.user = user
        self.children: dict[int, subprocess.Popen] = {}

    @staticmethod
    def wants_path(cache: Path) -> Path:
        return engine_state.state_dir(cache) / "rpc" / "workers.json"

    @classmethod
    def want(
        cls,
        cache: Path,
        replica_id: int,
        port: int,
        nonce: str,
        head: str,
        engine: str = "llamacpp",
        head_address: str = "",
        ray_port: int = 0,
    ) -> None:
        with engine_state.locked_state(cache):  # the state lock covers this file too
            path = cls.wants_path(cache)
            wants = json.loads(path.read_text()) if path.exists() else {}
            current = wants.get(str(replica_id), {})
            spec = {"port": int(port), "nonce": nonce, "head": head}
            if engine == "vllm":
                spec.update(engine=engine, head_address=head_address, ray_port=int(ray_port))
            # An entry with no engine is llama.cpp's.
            if {k: current.get(k) for k in spec} != spec or current.get("engine", "llamacpp") != engine:
                # Another group of the same id: what runs of the old one is stopped first.
                old = [current[k] for k in ("stunnel_pid", "server_pid", "ray_pid") if current.get(k)]
                wants[str(replica_id)] = {**spec, "wanted": True, "old_pids": current.get("old_pids", []) + old}
            else:
                # Sent again: wanted, and tried again if it had failed.
                current.update(wanted=True, failed=False, started=0.0)
            write_private(path, json.dumps(wants))

    @classmethod
    def unwant(cls, cache: Path, replica_id: int) -> bool:
        with engine_state.locked_state(cache):
            path = cls.wants_path(cache)
            wants = json.loads(path.read_text()) if path.exists() else {}
            if str(replica_id) not in wants:
                return False
            wants[str(replica_id)]["wanted"] = False
            write_private(path, json.dumps(wants))
            return True

    def step(self) -> None:
        with engine_state.locked_state(self.cache):
            path = self.wants_path(self.cache)
            wants = json.loads(path.read_text()) if path.exists() else {}
            said = []
            for replica_id, entry in list(wants.items()):
                for pid in entry.pop("old_pids", []):
                    engines.stop_group(pid, grace=3)
                if not entry.get("wanted"):
                    self._stop(entry)
                    shutil.rmtree(group_dir(self.cache, int(replica_id)), ignore_errors=True)
                    shutil.rmtree(ray_group.worker_dir(self.cache, int(replica_id)), ignore_errors=True)
                    wants.pop(replica_id)
                    said.append((int(replica_id), "stopped", ""))
                elif entry.get("engine") == "vllm":
                    said += self._ray_step(int(replica_id), entry)
                elif not entry.get("server_pid") and not entry.get("failed"):
                    said.append((int(replica_id), *self._start(int(replica_id), entry)))
                elif not entry.get("failed"):
                    said += self._check(int(replica_id), entry)
            if wants or path.exists():
                write_private(path, json.dumps(wants))
        for replica_id, state, reason in said:
            try:
                self.report(replica_id, state, "", reason, role="worker")
            except Exception:
                pass  # repeated at the next change; the broker may be away for a moment

    def _start(self, replica_id: int, entry: dict) -> tuple[str, str]:
        server, tunnel = rpc_server(), stunnel()
        if not server or not tunnel:
            entry["failed"] = True
            missing = " and ".join(n for n, b in (("rpc-server", server), ("stunnel", tunnel)) if not b)
            return "failed", f"this node cannot be an RPC worker: {missing} is not installed (docs/engines.md)"
        where = group_dir(self.cache, replica_id)
        where.mkdir(parents=True, exist_ok=True)
        local = engines.free_port("127.0.0.1")
        cache = tensor_cache(self.cache)
        cache.mkdir(parents=True, exist_ok=True)
        env = engines.engine_env("llamacpp", "", where)
        env["LLAMA_CACHE"] = str(cache)
        if self.user is not None:
            os.chown(cache, -1, self.user[1])
            cache.chmod(0o770)
        argv = [server, "--host", "127.0.0.1", "--port", str(local), "--cache"]
        rpc = engines.spawn(argv, where / "rpc-server.log", env, cwd=where, user=self.user)
        psk = groups.rpc_psk(self.key, replica_id, entry["nonce"])
        identity = groups.psk_identity(replica_id)
        psk_file = write_private(where / "psk.txt", f"{identity}:{psk}\n")
        config = stunnel_config(
            accept=f"{self.listen}:{entry['port']}",
            connect=f"127.0.0.1:{local}",
            psk_file=psk_file,
            identity=identity,
            client=False,
        )
        # stunnel runs as the agent (it reads the key); it holds nothing of the weights.
        tls = engines.spawn([tunnel, str(write_private(where / "stunnel.conf", config))], where / "stunnel.log", env)
        self.children[rpc.pid], self.children[tls.pid] = rpc, tls
        entry.update(server_pid=rpc.pid, stunnel_pid=tls.pid, local=local, ready=False, started=time.time())
        return "starting", ""

    def _check(self, replica_id: int, entry: dict) -> list[tuple[int, str, str]]:
        for name, key in (("rpc-server", "server_pid"), ("stunnel", "stunnel_pid")):
            pid = entry.get(key)
            if not _alive(self.children.get(pid), pid):
                self._stop(entry)
                entry["failed"] = True
                log = group_dir(self.cache, replica_id) / f"{name}.log"
                reason = f"this worker's {name} exited; its last lines:\n{engines.last_lines(log)}"
                return [(replica_id, "failed", reason)]
        if (
            not entry.get("ready")
            and answers_tcp("127.0.0.1", entry["local"])
            and answers_tcp(self.listen, entry["port"])
        ):
            entry["ready"] = True
            return [(replica_id, "ready", "")]
        return []

    def _ray_step(self, replica_id: int, entry: dict) -> list[tuple[int, str, str]]:
        """A vLLM worker: its `ray start` started, tried again until it joins, its exit reported."""
        now = time.time()
        if entry.get("failed"):
            return []
        if pid := entry.get("ray_pid"):
            said = ray_group.check_worker(self.cache, replica_id, entry, _alive(self.children.get(pid), pid), now)
            if not entry.get("ray_pid"):
                self.children.pop(pid, None)
            return [(replica_id, *said)] if said else []
        if now < entry.get("retry_at", 0):
            return []
        first = not entry.get("started")
        try:
            process = ray_group.start_worker(self.cache, replica_id, entry, self.listen, self.user, now)
        except (engines.EngineError, OSError) as e:
            entry["failed"] = True
            return [(replica_id, "failed", str(e))]
        self.children[process.pid] = process
        return [(replica_id, "starting", "")] if first else []

    def _stop(self, entry: dict) -> None:
        for key in ("stunnel_pid", "server_pid", "ray_pid"):
            if pid := entry.pop(key, None):
                engines.stop_group(pid, grace=3)
                if (child := self.children.pop(pid, None)) is not None:
                    child.wait(timeout=5)
        entry["ready"] = False


# --- the head ---------------------------------------------------------------------------


def layer_count(weights: Path) -> int:
    """The model's block count, from its GGUF header (the head's share is counted in layers)."""
    from gguf import GGUFReader

    fields = GGUFReader(weights, "r").fields
    for name, field in fields.items():
        if name.endswith(".block_count"):
            return int(field.parts[field.data[0]][0])
    raise ValueError(f"{weights} names no block count in its header")


def head_args(group: groups.GroupOrder, tunnels: list[int], layers: int) -> list[str]:
    """llama-server's arguments for a group: `--rpc` the tunnels, the workers' split, and the head's part.

    llama.cpp puts RPC devices first among the devices layers are split over, in the order
    of `--rpc`, and keeps the local CPU out of `--tensor-split`: layers not offloaded
    (`--n-gpu-layers` counts them from the end, output layer included) stay on the head's
    CPU, and those are the first. So the head's share is what `--n-gpu-layers` leaves out,
    and `--tensor-split` divides the rest between the workers in `--rpc`'s order.
    """
    total = layers + 1  # llama.cpp counts the output layer with the repeating ones
    offloaded = max(1, min(total, round(total * (1.0 - float(group["head_share"])))))
    return [
        "--rpc",
        ",".join(f"127.0.0.1:{port}" for port in tunnels),
        "--tensor-split",
        ",".join(f"{float(w['share']):g}" for w in group["workers"]),
        "--n-gpu-layers",
        str(offloaded),
    ]


class Tunnels:
    """The head's stunnel clients, one per worker, each on its own loopback port."""

    def __init__(self, cache: Path, key: str):
        self.cache = Path(cache)
        self.key = key  # the head's token hash: it opens the sealed keys

    def start(self, replica_id: int, nonce: str, group: groups.GroupOrder) -> tuple[list[int], list[int]]:
        """(loopback ports, stunnel pids), in the workers' order."""
        tunnel = stunnel()
        if tunnel is None:
            raise engines.EngineError("stunnel is not installed on this node, and a group's head needs it")
        where = group_dir(self.cache, replica_id)
        identity = groups.psk_identity(replica_id)
        ports, pids = [], []
        for n, worker in enumerate(group["workers"]):
            psk = groups.open_psk(self.key, worker["sealed_psk"], replica_id, nonce, worker["node"])
            psk_file = write_private(where / f"psk-{n}.txt", f"{identity}:{psk}\n")
            port = engines.free_port("127.0.0.1")
            config = stunnel_config(
                accept=f"127.0.0.1:{port}",
                connect=worker["endpoint"],
                psk_file=psk_file,
                identity=identity,
                client=True,
            )
            conf = write_private(where / f"stunnel-{n}.conf", config)
            process = engines.spawn([tunnel, str(conf)], where / f"stunnel-{n}.log", engines.engine_env(""))
            ports.append(port)
            pids.append(process.pid)
        # llama-server connects as it loads: each tunnel must be listening first.
        deadline = time.monotonic() + TUNNEL_START_S
        while not all(_listening(pid, port) for pid, port in zip(pids, ports, strict=True)):
            if time.monotonic() > deadline or not all(engines.group_alive(pid) for pid in pids):
                self.stop(pids)
                raise engines.EngineError(
                    f"stunnel did not listen within {TUNNEL_START_S:.0f} s; its log: {engines.last_lines(where / 'stunnel-0.log')}"
                )
            time.sleep(0.05)
        return ports, pids

    @staticmethod
    def stop(pids: list[int]) -> None:
        for pid in pids:
            engines.stop_group(pid, grace=2)

    @staticmethod
    def dropped(group: groups.GroupOrder, tunnels: dict) -> str:
        """For a ready head: which worker's connection is gone, in a sentence; empty when all hold.

        llama-server holds one connection to each worker from its start on; when a worker's
        rpc-server or stunnel dies its end closes the TLS connection, and when the network is
        cut the tunnel's TCP keepalive gives up (stunnel_config): either way the head's tunnel
        to it carries no connection any more. Read from the tunnel's sockets, without a byte sent.
        """
        lost = []
        for n, worker in enumerate(group["workers"]):
            pid = tunnels.get("pids", [])[n] if n < len(tunnels.get("pids", [])) else None
            if not pid or not engines.group_alive(pid):
                lost.append(f"{worker['node']} (the head's tunnel to it exited)")
                continue
            _, _, port = worker["endpoint"].rpartition(":")
            try:
                held = [
                    c
                    for c in psutil.Process(pid).net_connections(kind="tcp")
                    if c.status == psutil.CONN_ESTABLISHED and c.raddr and c.raddr.port == int(port)
                ]
            except psutil.Error:
                continue  # not readable here: the engine's own failure will say it
            if not held:
                lost.append(f"{worker['node']} at {worker['endpoint']} (the connection to it closed)")
        if not lost:
            return ""
        return f"lost its RPC worker{'s' if len(lost) > 1 else ''} {', '.join(lost)}"

    @staticmethod
    def lost(group: groups.GroupOrder, ports: list[int], pids: list[int]) -> str:
        """Which worker the head lost, in a sentence; empty when every tunnel still reaches its worker.

        Asked when the engine failed: its tunnel dead, or the worker's end not answering
        (its stunnel, rpc-server or node gone, or the network between cut).
        """
        lost = []
        for n, worker in enumerate(group["workers"]):
            if n < len(pids) and not engines.group_alive(pids[n]):
                lost.append(f"{worker['node']} (the head's tunnel to it exited)")
            elif n >= len(ports) or not rpc_answers("127.0.0.1", ports[n]):
                lost.append(f"{worker['node']} at {worker['endpoint']}")
        if not lost:
            return ""
        return f"lost its RPC worker{'s' if len(lost) > 1 else ''} {', '.join(lost)}"


# rpc-server's HELLO (ggml-rpc.cpp): command 14, the request's size, 24 bytes of connection capabilities.
RPC_HELLO = bytes([14]) + (24).to_bytes(8, "little") + bytes(24)


def rpc_answers(host: str, port: int, timeout: float = 3.0) -> bool:
    """An rpc-server answers HELLO at host:port (through a tunnel: the tunnel and the worker behind it)."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(RPC_HELLO)
            return len(s.recv(8)) > 0
    except OSError:
        return False
