"""Issue 37 end to end: one replica across two nodes, placed by the real control plane, in network namespaces.

The control plane runs on this host (tests/fleet_netns.py); nodes g1, g2 and g3 each run
`manage.py agent` in a namespace of their own. Each reports its real memory, and the catalog
entry asks for more than that (its profile's figure is the machine's memory and a half): no
node holds it alone, any two do, and its profile allows two nodes. So the control plane places
ONE replica whose head runs llama-server with --rpc and whose worker runs rpc-server behind
stunnel on another node. The tests run in order on that one fleet:

1. the group answers through the gateway, at temperature 0 token for token what a plain
   llama-server on the same GGUF and build answers alone;
2. a host on the fleet network that is not the head (the third node's namespace) connects to
   the worker's RPC port and gets no RPC answer: the stunnel PSK handshake fails;
3. the worker's rpc-server SIGKILLed fails the group with a sentence naming the worker, the
   control plane places a new group, and requests sent meanwhile are held and answered;
4. that new group's worker, on a node that held a share before, is sent the weights no second
   time: rpc-server's cache has them (the bytes its stunnel read, from /proc, while it runs);
5. a worker cut off the network (its link down) fails the group naming it, and a group on the
   nodes left answers what was sent meanwhile.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from . import netns

if reason := netns.unavailable():
    pytest.skip(reason, allow_module_level=True)

from agent import rpc_group  # noqa: E402

if not rpc_group.stunnel():
    pytest.skip("stunnel is missing: run scripts/test-deps.sh", allow_module_level=True)
if not (rpc_group.rpc_server() and rpc_group.can_be_head()):
    pytest.skip("rpc-server or a llama-server built with RPC is missing: run `make engine`", allow_module_level=True)

from agent import engine_binary, engines  # noqa: E402
from fleet.enrolment import issue_token  # noqa: E402
from fleet.models import Node as NodeRow  # noqa: E402
from fleet.models import Replica  # noqa: E402
from gateway.keys import create_key  # noqa: E402

from .fleet_netns import Asker, ControlPlane, Node, endpoint_host  # noqa: E402
from .staff_api import token_session  # noqa: E402
from .support.database import db_access  # noqa: E402, F401  (a fixture)
from .support.mirror import settle  # noqa: E402
from .support.rpc_group import probe, write_wide_llama  # noqa: E402
from .support.waiting import wait_until  # noqa: E402

pytestmark = pytest.mark.engine

NAMES = ("g1", "g2", "g3")
PROMPT = "Once upon a time"
ASK = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True}


# What the first group's worker read (tests 1 and 4): {node: bytes its stunnel read}.
FIRST_READ: dict[str, int] = {}


def programs(node: Node, name: str) -> dict[int, list[str]]:
    """{pid: argv} of the programs called `name` running in the node's namespace."""
    found = {}
    for pid in node.host.pids():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and Path(argv[0]).name == name:
            found[pid] = argv
    return found


def stunnel_read(node: Node, replica_id: int) -> int:
    """What the worker's stunnel for this replica has read (from the head and from rpc-server), in bytes."""
    [pid] = [pid for pid, argv in programs(node, "stunnel4").items() if f"replica-{replica_id}" in " ".join(argv)] or [
        pid for pid, argv in programs(node, "stunnel").items() if f"replica-{replica_id}" in " ".join(argv)
    ]
    io = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    return int(io["rchar"])


def machine_memory_gb() -> int:
    """What each node reports (agent/facts.py): they all share this host's memory."""
    return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30))


@pytest.fixture(scope="module")
def group_fleet(db_access, tmp_path_factory):  # noqa: F811  (the fixture imported above)
    log_dir = tmp_path_factory.mktemp("rpc-group-fleet")
    network = netns.Fleet()
    control = None
    nodes: dict[str, Node] = {}
    try:
        mirror = log_dir / "mirror"
        weights = log_dir / "gguf"
        with pytest.MonkeyPatch.context() as patch:
            write_wide_llama(weights, patch)
        (mirror / "wide" / "v1").mkdir(parents=True)
        for part in weights.glob("*.gguf"):
            (mirror / "wide" / "v1" / part.name).write_bytes(part.read_bytes())
        settle(mirror)
        control = ControlPlane(network, mirror, log_dir)
        for name in NAMES:
            host = network.add_host(name)
            node = Node(name, host, issue_token(name, address=host.address), control, log_dir)
            node.start_agent()
            nodes[name] = node
        yield control, nodes, weights
    finally:
        for node in nodes.values():
            node.kill_everything()
        if control is not None:
            control.stop()
        network.remove()


@pytest.fixture(scope="module")
def client(group_fleet) -> requests.Session:
    _, secret = create_key("rpc-group-fleet")
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {secret}"
    return session


def state(nodes: dict[str, Node]) -> str:
    rows = list(Replica.objects.values_list("pk", "node__name", "state", "reason"))
    shares = [(s.replica_id, s.node.name, s.state) for r in Replica.objects.all() for s in r.shares.all()]
    return f"replicas {rows}; shares {shares}; agents {[n.agent.output()[-1500:] for n in nodes.values()]}"


def serve_across_two(control: ControlPlane) -> None:
    api = token_session()
    plan = wait_until(
        lambda: (r := api.get(control.admin_url + "/api/serve/plan/?model=wide&version=v1")).ok and r.json(),
        timeout=30,
        what="the mirror scan to find wide/v1",
    )
    need = machine_memory_gb() * 3 // 2
    body = {"name": "wide", "source": plan["source"], "engine": "llamacpp", "profile": plan["profile"]}
    body |= {"context_length": 256, "ctx_size": 256, "replicas": 1, "min_memory_gb": need, "nodes": 2}
    served = api.post(control.admin_url + "/api/serve/", json=body)
    assert served.status_code == 201, served.text


@pytest.fixture(scope="module")
def group(group_fleet, client) -> Replica:
    """The one replica across two nodes, ready and routed by the gateway."""
    control, nodes, _ = group_fleet

    def enrolled():
        rows = {n.name: n for n in NodeRow.objects.all()}
        return all(
            name in rows and rows[name].state == NodeRow.State.READY and rows[name].rpc and rows[name].rpc_head
            for name in NAMES
        )

    wait_until(enrolled, timeout=90, interval=0.5, what=lambda: f"the nodes to enrol able to group: {state(nodes)}")
    serve_across_two(control)
    replica = wait_until(
        lambda: (r := Replica.objects.filter(model_name="wide", state="ready").first()) and r,
        240,
        interval=0.5,
        what=lambda: f"the group to be ready: {state(nodes)}",
    )
    wait_until(
        lambda: client.post(control.gateway_urls[0] + "/v1/completions", json={"model": "wide", **ASK}, timeout=60).ok,
        30,
        what="the gateway to route wide",
    )
    return replica


def alone(weights, log_dir) -> str:
    """The same GGUF on one plain llama-server of the same build, on loopback: its text at temperature 0."""
    port = engines.free_port("127.0.0.1")
    [gguf] = weights.glob("*.gguf")
    argv = [str(engine_binary.llama_server()), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["-c", "256", "--alias", "wide"]
    with open(log_dir / "alone.log", "wb") as log:
        server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"

        def up():
            assert server.poll() is None, (log_dir / "alone.log").read_text()[-2000:]
            try:
                return requests.get(url + "/health", timeout=2).ok
            except requests.RequestException:
                return False

        wait_until(up, 60, what="the plain llama-server")
        answer = requests.post(url + "/v1/completions", json={"model": "wide", **ASK}, timeout=60)
        assert answer.ok, answer.text
        return answer.json()["choices"][0]["text"]
    finally:
        server.kill()
        server.wait(timeout=10)


def test_three_nodes_each_too_small_serve_one_replica_across_two_that_answers_as_the_model_alone(
    group_fleet, client, group, tmp_path
):
    control, nodes, weights = group_fleet
    shares = list(group.shares.select_related("node"))
    assert len(shares) == 1, state(nodes)
    [worker] = shares
    assert worker.node.name != group.node.name
    assert endpoint_host(group.endpoint) == nodes[group.node.name].host.address

    answer = client.post(control.gateway_urls[0] + "/v1/completions", json={"model": "wide", **ASK}, timeout=60)
    assert answer.status_code == 200, answer.text
    assert int(answer.headers["x-llmgw-replica"]) == group.pk
    assert answer.json()["usage"]["completion_tokens"] == ASK["max_tokens"]
    assert answer.json()["choices"][0]["text"] == alone(weights, tmp_path)
    FIRST_READ[worker.node.name] = stunnel_read(nodes[worker.node.name], group.pk)


def test_a_host_on_the_fleet_network_that_is_not_the_head_gets_no_rpc_answer_from_the_worker(group_fleet, group):
    _, nodes, _ = group_fleet
    [worker] = list(group.shares.select_related("node"))
    stranger = next(n for name, n in nodes.items() if name not in (group.node.name, worker.node.name))
    address = nodes[worker.node.name].host.address
    said = probe(stranger.host.argv([]), sys.executable, address, worker.port)
    # The port takes the connection (the worker's stunnel listens there) and closes it: no RPC answer.
    assert said == "closed", said


def fail_and_replace(control: ControlPlane, client: requests.Session, nodes: dict, replica: Replica, fault):
    """`fault(worker)` acted out on the replica's worker while a client asks on through the gateway.

    Until a new group is ready and has answered; returns it, every reason the old group's
    record showed meanwhile, and the requests begun between the fault and the new group.
    """
    [share] = list(replica.shares.select_related("node"))
    chat = {"model": "wide", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    asker = Asker(control.gateway_urls, client.headers["Authorization"].split()[1], chat)
    said: set[str] = set()

    def replaced():
        old = Replica.objects.filter(pk=replica.pk).values_list("reason", flat=True).first()
        if old:
            said.add(old)
        return Replica.objects.filter(model_name="wide", state="ready").exclude(pk=replica.pk).first()

    with asker:
        wait_until(lambda: len(asker.outcomes) >= 2, 30, what="the client's first answers")
        fault(nodes[share.node.name])
        faulted = time.monotonic()
        new = wait_until(replaced, 180, interval=0.2, what=lambda: f"a new group: {state(nodes)}")
        ready = time.monotonic()
        wait_until(
            lambda: any(o[0] > ready and o[1] == 200 for o in asker.outcomes),
            60,
            what=lambda: f"an answer from the new group: {asker.outcomes[-3:]}",
        )
    # The sentence on the group's record names the worker.
    assert any(share.node.name in reason for reason in said), said
    # Requests were sent while no group was ready: held, and every one answered by the new group.
    assert [o for o in asker.outcomes if faulted < o[0] < ready], asker.outcomes
    assert asker.failures(since=faulted) == [], asker.failures(since=faulted)
    assert new.shares.count() == 1
    return new


def test_a_worker_rpc_server_killed_fails_the_group_naming_it_and_a_new_group_answers_what_was_held(
    group_fleet, client, group
):
    control, nodes, _ = group_fleet

    def kill_rpc_server(worker: Node):
        [rpc_server] = programs(worker, "rpc-server")
        os.kill(rpc_server, signal.SIGKILL)

    fail_and_replace(control, client, nodes, group, kill_rpc_server)


def test_a_new_group_sends_the_weights_a_second_time_to_no_worker(group_fleet, group):
    _, nodes, _ = group_fleet
    new = Replica.objects.filter(model_name="wide", state="ready").exclude(pk=group.pk).first()
    assert new is not None
    [share] = list(new.shares.select_related("node"))
    assert share.node.name in FIRST_READ, f"the new group's worker {share.node.name} held no share before"
    again = stunnel_read(nodes[share.node.name], new.pk)
    # The first start carried the worker's layers (its share of the 70 MB, tensors of 11.5 MB);
    # this one only their hashes, which rpc-server found in its cache.
    assert FIRST_READ[share.node.name] > 20_000_000, FIRST_READ
    assert again < FIRST_READ[share.node.name] / 10, (again, FIRST_READ)


def test_a_worker_cut_off_the_network_fails_the_group_naming_it_and_a_group_on_the_nodes_left_answers(
    group_fleet, client, group
):
    control, nodes, _ = group_fleet
    current = Replica.objects.filter(model_name="wide", state="ready").exclude(pk=group.pk).get()
    [share] = list(current.shares.select_related("node"))
    try:
        new = fail_and_replace(control, client, nodes, current, lambda worker: worker.host.cut())
        assert share.node.name not in [new.node.name, *(s.node.name for s in new.shares.all())]
    finally:
        nodes[share.node.name].host.restore()
