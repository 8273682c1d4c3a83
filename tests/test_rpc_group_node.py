"""One replica across two nodes, the nodes' side (issue 37, contracts/groups.py): a real llama-server
as the head, a real rpc-server behind stunnel as the worker, and a stranger on the fleet network.

The worker's stunnel listens on this host's address on a test bridge (tests/netns.py); the stranger
is a network namespace on that bridge, so what it reaches is what another machine on the fleet
network could. Both supervisors run in the test process (tests/support/rpc_group.py).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from pathlib import Path

import pytest
import requests

from agent import engine_binary, engine_state, engines, rpc_group, supervisor
from contracts import groups, signing

from . import netns
from .support.rpc_group import STAND_IN, Reports, bytes_to_rpc_server, probe, worker_entry, write_wide_llama
from .support.waiting import wait_until

if reason := netns.unavailable():
    pytest.skip(reason, allow_module_level=True)
if not rpc_group.stunnel():
    pytest.skip("stunnel is missing: run scripts/test-deps.sh", allow_module_level=True)
needs_rpc_build = pytest.mark.skipif(
    not (rpc_group.rpc_server() and rpc_group.can_be_head()),
    reason="rpc-server or a llama-server built with RPC is missing: run `make engine`",
)

HEAD_TOKEN, WORKER_TOKEN = "llmgw-node-head-token", "llmgw-node-worker-token"
GROUP, ALONE = 1, 2  # the replica across two nodes, and the same model on the head alone
NONCE = "1700000000000001"
ASK = {"prompt": "Once upon a time", "n_predict": 16, "temperature": 0, "ignore_eos": True, "return_tokens": True}


class Group:
    """The head's and the worker's supervisors, and what starts and stops the group."""

    def __init__(self, root: Path, weights: Path, listen: str):
        self.weights = weights
        self.head_cache, self.worker_cache = root / "head", root / "worker"
        self.head_reports, self.worker_reports = Reports(), Reports()
        self.head = supervisor.Supervisor(self.head_cache, self.head_reports, token=HEAD_TOKEN, backoff_max=2)
        self.worker = supervisor.Supervisor(
            self.worker_cache, self.worker_reports, token=WORKER_TOKEN, rpc_listen=listen
        )
        self.listen = listen
        self.port = engines.free_port(listen)

    def order(self) -> groups.GroupOrder:
        head_key, worker_key = signing.token_hash(HEAD_TOKEN), signing.token_hash(WORKER_TOKEN)
        psk = groups.rpc_psk(worker_key, GROUP, NONCE)
        worker = groups.GroupWorker(
            node="worker-1",
            endpoint=f"{self.listen}:{self.port}",
            sealed_psk=groups.seal_psk(head_key, psk, GROUP, NONCE, "worker-1"),
            share=1.0,
        )
        return groups.GroupOrder(head_share=0.5, workers=[worker])

    def step_until(self, condition, what: str, timeout: float = 60):
        def stepped():
            self.worker.step()
            self.head.step()
            return condition()

        return wait_until(stepped, timeout=timeout, interval=0.2, what=what)

    def worker_ready(self) -> bool:
        return bool(worker_entry(self.worker_cache, GROUP).get("ready"))

    def head_ready(self, replica_id: int = GROUP) -> bool:
        return bool(engine_state.read_state(self.head_cache)["replicas"].get(str(replica_id), {}).get("ready"))

    def start(self) -> None:
        if not self.worker_ready():
            self.stop_worker()
            rpc_group.Workers.want(self.worker_cache, GROUP, self.port, NONCE, "head")
            self.step_until(self.worker_ready, "the worker's rpc-server and stunnel to answer")
        if not self.head_ready():
            engine_state.want(
                self.head_cache, GROUP, "llamacpp", "http://m/", self.weights, [], "wide", NONCE, self.order()
            )
            self.step_until(self.head_ready, "the group's head to answer, its worker's layers loaded over RPC", 120)

    def stop_head(self, replica_id: int = GROUP) -> None:
        if engine_state.unwant(self.head_cache, replica_id):
            self.step_until(
                lambda: str(replica_id) not in engine_state.read_state(self.head_cache)["replicas"],
                "the head's engine to stop",
            )

    def stop_worker(self) -> None:
        if rpc_group.Workers.unwant(self.worker_cache, GROUP):
            self.step_until(lambda: not worker_entry(self.worker_cache, GROUP), "the worker to stop")

    def ask(self, replica_id: int) -> list[int]:
        entry = engine_state.read_state(self.head_cache)["replicas"][str(replica_id)]
        answer = requests.post(
            f"http://127.0.0.1:{entry['port']}/completion",
            json=ASK,
            headers={"Authorization": f"Bearer {self.head.secret(entry)}"},
            timeout=120,
        )
        answer.raise_for_status()
        return answer.json()["tokens"]

    def stunnel_log(self) -> Path:
        return rpc_group.group_dir(self.worker_cache, GROUP) / "stunnel.log"


@pytest.fixture(scope="module")
def network():
    fleet = netns.Fleet()
    stranger = fleet.add_host("stranger")
    try:
        yield fleet, stranger
    finally:
        fleet.remove()


@pytest.fixture(scope="module")
def group(network, tmp_path_factory):
    fleet, _ = network
    weights = write_wide_llama(tmp_path_factory.mktemp("wide"), pytest.MonkeyPatch())
    made = Group(tmp_path_factory.mktemp("group"), weights, fleet.address)
    try:
        made.start()
        yield made
    finally:
        for replica_id in (GROUP, ALONE):
            engine_state.unwant(made.head_cache, replica_id)
        rpc_group.Workers.unwant(made.worker_cache, GROUP)
        made.head.step()
        made.worker.step()
        for entry in engine_state.read_state(made.head_cache)["replicas"].values():
            if entry.get("pid"):
                engines.stop_group(entry["pid"], grace=2)
            rpc_group.Tunnels.stop(entry.get("tunnels", {}).get("pids", []))


@needs_rpc_build
def test_the_group_answers_token_for_token_what_the_model_answers_on_one_node(group):
    group.start()
    across = group.ask(GROUP)
    engine_state.want(group.head_cache, ALONE, "llamacpp", "http://m/", group.weights, [], "wide", NONCE)
    group.step_until(lambda: group.head_ready(ALONE), "the same model on the head alone to answer")
    alone = group.ask(ALONE)
    group.stop_head(ALONE)
    assert len(across) == ASK["n_predict"]
    assert across == alone
    # It really ran across two: the head's llama-server was given the worker's tunnel, and the worker was sent layers.
    argv = engine_state.read_state(group.head_cache)["replicas"][str(GROUP)]["argv"]
    assert "--rpc" in argv and "--tensor-split" in argv
    assert worker_entry(group.worker_cache, GROUP)["ready"]
    assert ("ready", "") in [(r[1], r[3]) for r in group.worker_reports.of(GROUP, role="worker")]


@needs_rpc_build
def test_a_stranger_on_the_fleet_network_gets_nothing_from_the_worker(group, network, tmp_path):
    fleet, stranger = network
    group.start()
    # rpc-server serves one client at a time: the head's connection is let go, so that a
    # probe that got through would be answered (the control below shows it would be).
    group.stop_head()
    local = worker_entry(group.worker_cache, GROUP)["local"]
    python = sys.executable
    # rpc-server's own port, on the worker's fleet address: not there (it listens on loopback).
    assert probe(stranger.argv([]), python, fleet.address, local) == "refused"
    # The stunnel port spoken to in RPC directly, without TLS: closed, nothing answered.
    assert probe(stranger.argv([]), python, fleet.address, group.port) == "closed"

    # Through a TLS-PSK client of its own: with a key of its making, then with the worker's.
    def through_stunnel(psk: str, name: str) -> str:
        port = 5555  # on the stranger's own loopback: its namespace is this run's alone
        psk_file = rpc_group.write_private(tmp_path / f"{name}.psk", f"{groups.psk_identity(GROUP)}:{psk}\n")
        config = rpc_group.stunnel_config(
            accept=f"127.0.0.1:{port}",
            connect=f"{fleet.address}:{group.port}",
            psk_file=psk_file,
            identity=groups.psk_identity(GROUP),
            client=True,
        )
        conf = rpc_group.write_private(tmp_path / f"{name}.conf", config)
        tunnel = engines.spawn(stranger.argv([rpc_group.stunnel(), str(conf)]), tmp_path / f"{name}.log")
        try:
            wait_until(
                lambda: probe(stranger.argv([]), python, "127.0.0.1", port) != "refused",
                what="the stranger's own stunnel to listen",
            )
            return probe(stranger.argv([]), python, "127.0.0.1", port)
        finally:
            engines.stop_group(tunnel.pid, grace=2)

    wrong = groups.rpc_psk(signing.token_hash("another node's token"), GROUP, NONCE)
    assert through_stunnel(wrong, "wrong") == "closed"
    # The control: the same client with the worker's own key is answered, so "closed" above was the key.
    right = groups.rpc_psk(signing.token_hash(WORKER_TOKEN), GROUP, NONCE)
    assert through_stunnel(right, "right") == "answered"
    # Every file that holds the key is the agent's alone.
    for path in rpc_group.group_dir(group.worker_cache, GROUP).glob("*"):
        if path.suffix in (".txt", ".conf"):
            assert path.stat().st_mode & 0o777 == 0o600, path


@needs_rpc_build
def test_a_restarted_group_sends_no_tensor_twice(group):
    group.stop_head()
    group.stop_worker()
    cached = rpc_group.tensor_cache(group.worker_cache) / "rpc"
    for old in cached.glob("*"):
        old.unlink()

    def one_start() -> int:
        group.start()
        group.stop_head()  # the connection closes, and the worker's stunnel logs what it carried
        log = group.stunnel_log()
        sent = wait_until(
            lambda: bytes_to_rpc_server(log) is not None and (bytes_to_rpc_server(log),),
            what="the worker's stunnel to log the bytes of every connection it passed on",
        )[0]
        group.stop_worker()  # the worker too: its rpc-server starts anew, with only its cache on disk
        return sent

    first = one_start()
    held = sum(p.stat().st_size for p in cached.glob("*"))
    second = one_start()
    # The worker's share holds three 11.5 MB matrices (layer 1's feed-forward): sent once, then kept.
    assert held >= 3 * 11_000_000
    assert first >= held
    assert second < first / 10, f"the second start sent {second} bytes, the first {first}"


@needs_rpc_build
def test_a_worker_whose_rpc_server_is_killed_fails_the_group_naming_it(group):
    group.start()
    pid = worker_entry(group.worker_cache, GROUP)["server_pid"]
    before = len(group.head_reports)
    os.kill(pid, signal.SIGKILL)
    group.step_until(
        lambda: any(r[1] == "failed" for r in group.head_reports[before:] if r[0] == GROUP),
        "the head to report its replica failed",
    )
    failed = [r for r in group.head_reports[before:] if r[0] == GROUP and r[1] == "failed"][0]
    assert "worker-1" in failed[3], failed[3]
    worker_failed = [r for r in group.worker_reports.of(GROUP, role="worker") if r[1] == "failed"]
    assert worker_failed and "rpc-server" in worker_failed[-1][3]


@needs_rpc_build
@pytest.mark.processes  # agent.facts runs rpc-server, stunnel and llama-server to see that they run
def test_the_node_says_it_can_be_a_worker_and_a_head_only_when_its_programs_run(monkeypatch):
    assert engine_binary.llama_server()
    assert rpc_group.can_be_worker() and rpc_group.can_be_head()
    # A program that is there but is no rpc-server (or no stunnel) is not taken for one.
    monkeypatch.setenv(rpc_group.RPC_SERVER_SETTING, "/bin/true")
    assert not rpc_group.can_be_worker()
    monkeypatch.delenv(rpc_group.RPC_SERVER_SETTING)
    monkeypatch.setenv(rpc_group.STUNNEL_SETTING, "/bin/false")
    assert not rpc_group.can_be_worker() and not rpc_group.can_be_head()


def test_a_worker_is_started_only_by_an_order_the_control_plane_signed_for_this_node(tmp_path, monkeypatch):
    from agent.rpc_tasks import start_rpc_worker

    monkeypatch.setenv("LLMGW_NODE_NAME", "worker-1")
    monkeypatch.setenv("LLMGW_NODE_TOKEN", WORKER_TOKEN)
    monkeypatch.setenv("LLMGW_AGENT_CACHE", str(tmp_path))
    args, extra = [7, 7070], {"nonce": NONCE, "head": "head", "source": "http://m/", "memory_bytes": 1}
    # Signed with another node's key, or for another node: dropped, nothing wanted.
    for key, node in (
        (signing.token_hash("another node's token"), "worker-1"),
        (signing.token_hash(WORKER_TOKEN), "n2"),
    ):
        start_rpc_worker.apply(args=args, kwargs=signing.with_proof(key, groups.START_RPC_WORKER, node, args, extra))
        assert not worker_entry(tmp_path, 7)
    genuine = signing.with_proof(signing.token_hash(WORKER_TOKEN), groups.START_RPC_WORKER, "worker-1", args, extra)
    start_rpc_worker.apply(args=args, kwargs=genuine)
    assert worker_entry(tmp_path, 7) == {"port": 7070, "nonce": NONCE, "head": "head", "wanted": True, "old_pids": []}


def test_a_worker_lost_behind_its_tunnel_is_named_by_the_head_and_the_worker_says_which_program_died(
    tmp_path, monkeypatch
):
    # The tunnels' side alone, against a stand-in rpc-server (tests/support/rpc_group.py STAND_IN):
    # runs where the RPC build is missing too.
    stand_in = tmp_path / "rpc-server"
    stand_in.write_text(STAND_IN.format(python=sys.executable))
    stand_in.chmod(0o755)
    monkeypatch.setenv(rpc_group.RPC_SERVER_SETTING, str(stand_in))
    reports = Reports()
    worker = supervisor.Supervisor(tmp_path / "w", reports, token=WORKER_TOKEN, rpc_listen="127.0.0.1")
    port = engines.free_port()
    rpc_group.Workers.want(tmp_path / "w", GROUP, port, NONCE, "head")
    pids: list[int] = []
    try:
        wait_until(
            lambda: (worker.step(), worker_entry(tmp_path / "w", GROUP).get("ready"))[1], what="the worker to be ready"
        )
        head_key = signing.token_hash(HEAD_TOKEN)
        psk = groups.rpc_psk(signing.token_hash(WORKER_TOKEN), GROUP, NONCE)
        order = groups.GroupOrder(
            head_share=0.5,
            workers=[
                groups.GroupWorker(
                    node="worker-1",
                    endpoint=f"127.0.0.1:{port}",
                    sealed_psk=groups.seal_psk(head_key, psk, GROUP, NONCE, "worker-1"),
                    share=1.0,
                )
            ],
        )
        (tmp_path / "h").mkdir()
        ports, pids = rpc_group.Tunnels(tmp_path / "h", head_key).start(GROUP, NONCE, order)
        tunnels = {"ports": ports, "pids": pids}
        held = socket.create_connection(("127.0.0.1", ports[0]))  # as llama-server holds its own
        held.sendall(rpc_group.RPC_HELLO)
        assert held.recv(64)
        assert rpc_group.Tunnels.dropped(order, tunnels) == ""
        os.kill(worker_entry(tmp_path / "w", GROUP)["server_pid"], signal.SIGKILL)
        # The worker's agent runs on meanwhile: it stops the stunnel of a worker whose rpc-server died.
        said = wait_until(
            lambda: (worker.step(), rpc_group.Tunnels.dropped(order, tunnels))[1],
            what="the head to see its worker gone",
        )
        assert said.startswith("lost its RPC worker worker-1 at 127.0.0.1:")
        assert "worker-1" in rpc_group.Tunnels.lost(order, ports, pids)
        wait_until(
            lambda: (worker.step(), "failed" in reports.states(GROUP, role="worker"))[1], what="the worker's report"
        )
        assert "rpc-server exited" in reports.of(GROUP, role="worker")[-1][3]
        held.close()
    finally:
        rpc_group.Tunnels.stop(pids)
        rpc_group.Workers.unwant(tmp_path / "w", GROUP)
        worker.step()
