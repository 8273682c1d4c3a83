"""A fleet across hosts, with hosts as network namespaces: every part real, every fault acted out.

The control plane runs on this host (the admin server and two gateways on loopback; Redis and the byte
listener on a bridge the test makes); nodes n1 and n2 each run `manage.py agent` in a
network namespace of their own, with their own cache, no database, and only the bridge
to talk on. Their llama.cpp engines listen on the node's bridge address and the gateway
reaches them over the bridge. The tests run in order on one fleet, each one fault:

1. both nodes enrol, and a model with two replicas answers from both nodes' addresses;
2. a node cut off mid-fetch (link down, processes killed) has its replicas placed on the
   other node, and the gateway keeps answering all along;
3. a node that comes back, its engines still running from before it was cut off, stops
   them: the model runs as many replicas as the catalog says and the gateway never
   sends the stale engines a request;
4. the control plane killed and started again while replicas serve: every request
   answered, nothing placed twice, no engine restarted.

"Serving never stops" in 4: the gateways are processes of their own, and an operator who
needs no gap runs two behind a load balancer (docs/fleet.md), and so does the test:
everything else (admin server, worker, byte listener, Redis) is killed at once with one
gateway, then the other gateway. The client goes to the first gateway that takes its connection, as a
load balancer would, and every one of its requests must be answered.
"""

from __future__ import annotations

import datetime
import shutil
import subprocess
import sys
import time

import pytest
import requests

from . import netns

if reason := netns.unavailable():
    pytest.skip(reason, allow_module_level=True)

from django.utils import timezone  # noqa: E402

from agent.fetch import cache_path  # noqa: E402
from fleet.enrolment import issue_token  # noqa: E402
from fleet.models import Node as NodeRow  # noqa: E402
from fleet.models import Replica  # noqa: E402
from gateway.keys import create_key  # noqa: E402
from launcher.demo_model import EOS_TOKEN_ID, write_tiny_llama  # noqa: E402

from .fleet_netns import Asker, ControlPlane, Node, chat_requests_in, endpoint_host  # noqa: E402
from .staff_api import token_session  # noqa: E402
from .support.database import db_access  # noqa: E402, F401  (a fixture)
from .support.mirror import settle  # noqa: E402
from .support.waiting import wait_until  # noqa: E402

pytestmark = pytest.mark.engine

ASK = {
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 4,
    "logit_bias": {str(EOS_TOKEN_ID): -100},
}


@pytest.fixture(scope="module")
def engine_fleet(db_access, tmp_path_factory):  # noqa: F811  (db_access: the fixture imported above)
    """The bridge, the control plane on this host, and nodes n1 and n2 in their namespaces; all removed at the end."""
    log_dir = tmp_path_factory.mktemp("fleet-netns")
    network = netns.Fleet()
    control = None
    nodes: list[Node] = []
    try:
        mirror = log_dir / "mirror"
        write_tiny_llama(log_dir / "gguf")
        for version in ("v1", "v2"):  # the same weights twice: a second source to fetch
            (mirror / "tiny" / version).mkdir(parents=True)
            for part in (log_dir / "gguf").glob("*.gguf"):
                shutil.copyfile(part, mirror / "tiny" / version / part.name)
        settle(mirror)  # copied in a while ago: whole, not still being written
        control = ControlPlane(network, mirror, log_dir)
        for name in ("n1", "n2"):
            host = network.add_host(name)
            # Enrolled at its bridge address: the only place its engines are routed to.
            node = Node(name, host, issue_token(name, address=host.address), control, log_dir)
            node.start_agent()
            nodes.append(node)
        yield control, nodes
    finally:
        for node in nodes:
            node.kill_everything()
        if control is not None:
            control.stop()
        network.remove()


@pytest.fixture(scope="module")
def client_key(engine_fleet):
    _, secret = create_key("fleet-netns")
    return secret


def serve(control: ControlPlane, name: str, version: str) -> str:
    """Serve a mirrored version with two replicas, through the API, as staff do; returns its source."""
    api = token_session()
    url = control.admin_url
    plan = wait_until(
        lambda: (r := api.get(url + f"/api/serve/plan/?model=tiny&version={version}")).ok and r.json(),
        timeout=30,
        what=f"the mirror scan to find tiny/{version}",
    )
    body = {"name": name, "source": plan["source"], "engine": plan["engine"], "profile": plan["profile"]}
    body |= {"context_length": 256, "ctx_size": 256, "replicas": 2, "min_memory_gb": plan["min_memory_gb"]}
    served = api.post(url + "/api/serve/", json=body)
    assert served.status_code == 201, served.text
    return plan["source"]


def ready(model: str) -> list[Replica]:
    return list(Replica.objects.filter(model_name=model, state="ready").select_related("node"))


def placed_at_most(model: str, count: int, seen: list[int]) -> None:
    """Sampled while waiting: a model never has more replica rows than the catalog says."""
    rows = Replica.objects.filter(model_name=model).count()
    seen.append(rows)
    assert rows <= count, f"{model} has {rows} replicas placed, the catalog says {count}"


def answered_more(asker: Asker, n: int, timeout: float = 60) -> None:
    """Wait until the client has had `n` more answers than it has now: it asked on through what came before."""
    start = sum(1 for o in asker.outcomes if o[1] == 200)
    wait_until(
        lambda: sum(1 for o in asker.outcomes if o[1] == 200) >= start + n,
        timeout,
        what=lambda: f"{n} more answers to the client; its last outcomes: {asker.outcomes[-3:]}",
        interval=0.1,
    )


def routed(control: ControlPlane, key: str, model: str = "tiny") -> None:
    """Until both gateways answer `model`: what the database says is ready, their tables say too."""
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {key}"

    def answered():
        return all(
            session.post(url + "/v1/chat/completions", json={"model": model, **ASK}, timeout=60).status_code == 200
            for url in control.gateway_urls
        )

    wait_until(answered, 20, what=lambda: f"both gateways to answer {model}")


def state(nodes: list[Node]) -> str:
    rows = list(Replica.objects.values_list("model_name", "node__name", "state", "reason"))
    return f"replicas {rows}; engines {[n.engines() for n in nodes]}"


def test_both_nodes_enrol_and_two_replicas_answer_through_the_gateway_from_the_nodes_own_addresses(
    engine_fleet, client_key
):
    control, nodes = engine_fleet

    def enrolled():
        rows = {n.name: n for n in NodeRow.objects.all()}
        return all(
            name in rows and rows[name].state == NodeRow.State.READY and "llamacpp" in rows[name].engines
            for name in ("n1", "n2")
        )

    wait_until(enrolled, timeout=90, interval=0.5, what=f"both nodes to enrol\n{nodes[0].agent.output()[-2000:]}")
    serve(control, "tiny", "v1")
    replicas = wait_until(
        lambda: len(r := ready("tiny")) == 2 and r, 240, what=lambda: f"two ready replicas: {state(nodes)}"
    )
    addresses = {node.name: node.host.address for node in nodes}
    # Spread over both nodes, each replica at its own node's address on the bridge.
    assert sorted(r.node.name for r in replicas) == ["n1", "n2"]
    for replica in replicas:
        assert endpoint_host(replica.endpoint) == addresses[replica.node.name], replica.endpoint

    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {client_key}"
    gateway = control.gateway_urls[0]
    wait_until(
        lambda: any(m["ready"] for m in session.get(gateway + "/v1/models").json().get("data", [])),
        timeout=10,
        what="the gateway to route tiny",
    )
    # Both replicas answer: asked until each has (the gateway's table may take a refresh
    # to hold the second one), for at most 30 s.
    answered_by = set()
    deadline = time.monotonic() + 30
    n = 0
    while answered_by != {r.pk for r in replicas} and time.monotonic() < deadline:
        # A conversation of its own each time: the gateway sends one conversation to one replica (by prefix).
        n += 1
        ask = dict(ASK, messages=[{"role": "user", "content": f"hi {n}"}])
        answer = session.post(gateway + "/v1/chat/completions", json={"model": "tiny", **ask}, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] > 0
        answered_by.add(int(answer.headers["x-llmgw-replica"]))
    assert answered_by == {r.pk for r in replicas}
    # And the engines say so themselves: each answered chat requests, in its own namespace.
    for replica in replicas:
        node = next(n for n in nodes if n.name == replica.node.name)
        assert chat_requests_in(node.engine_log(replica.pk)) > 0


def test_a_nodes_engine_refuses_a_request_from_the_network_without_its_replica_secret(engine_fleet, client_key):
    control, nodes = engine_fleet
    replicas = ready("tiny")
    assert len(replicas) == 2
    for replica in replicas:
        # Straight to the engine at the node's address, over the bridge, as anyone on the network can.
        for headers in ({}, {"Authorization": f"Bearer {client_key}"}, {"Authorization": "Bearer llmgw-replica-0"}):
            direct = requests.post(replica.endpoint + "/chat/completions", json=ASK, headers=headers, timeout=30)
            assert direct.status_code == 401, (replica.endpoint, headers, direct.status_code, direct.text[:200])
            assert "choices" not in direct.text
    # Through the gateway, which presents each replica's secret, the same engines answer.
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {client_key}"
    answer = session.post(control.gateway_urls[0] + "/v1/chat/completions", json={"model": "tiny", **ASK}, timeout=60)
    assert answer.status_code == 200, answer.text


STRANGER_READS = """
import sys, requests
base = sys.argv[1]
for method, path, headers in [
    ("GET", "tiny/v1/", {}),
    ("GET", "tiny/v1/tiny-00001-of-00003.gguf", {}),
    ("HEAD", "tiny/v1/tiny-00001-of-00003.gguf", {}),
    ("GET", "tiny/v1/tiny-00001-of-00003.gguf", {"Range": "bytes=0-3"}),
    ("GET", "tiny/v1/tiny-00001-of-00003.gguf", {"Authorization": "Bearer n1:9999999999:0badc0de"}),
]:
    r = requests.request(method, base + path, headers=headers, timeout=10)
    print(r.status_code, b"GGUF" in r.content, flush=True)
"""


def test_a_host_on_the_fleets_network_without_a_nodes_credentials_gets_nothing_from_the_byte_listener(engine_fleet):
    control, nodes = engine_fleet
    stranger = control.fleet.add_host("x")
    for url in (control.byte_listener_url, control.bytes_url):  # the listener, and the way the nodes go
        reads = subprocess.run(
            stranger.argv([sys.executable, "-c", STRANGER_READS, url]), capture_output=True, text=True, timeout=60
        )
        assert reads.returncode == 0, reads.stderr
        assert reads.stdout.split("\n")[:-1] == ["401 False"] * 5, reads.stdout
    # The enrolled nodes, on the same network, fetched the same files with their passes.
    assert all(cache_path(control.bytes_url + "tiny/v1/", n.cache).joinpath(".complete").exists() for n in nodes)


def test_a_node_cut_off_mid_fetch_has_its_replicas_placed_on_the_other_and_the_gateway_keeps_answering(
    engine_fleet, client_key
):
    control, (n1, n2) = engine_fleet
    control.proxy.rate = 4000  # bytes a second for each file: a fetch of the second model takes a minute
    source = serve(control, "late", "v2")
    target = cache_path(source, n1.cache)

    def fetching_on_n1():
        parts = list(target.glob("*.part")) if target.is_dir() else []
        return parts if any(p.stat().st_size > 0 for p in parts) else None

    wait_until(fetching_on_n1, 60, what=lambda: f"n1 to be fetching late: {state([n1, n2])}", interval=0.2)
    routed(control, client_key)
    seen: list[int] = []
    with Asker(control.gateway_urls, client_key, {"model": "tiny", **ASK}) as asker:
        answered_more(asker, 5)  # asking, on kept-alive connections, before the cut
        cut_at = time.monotonic()
        n1.host.cut()
        n1.kill_everything()
        wait_until(lambda: not n1.engines(), 10, what=lambda: f"n1's engines to die: {n1.engines()}")
        assert not (target / ".complete").exists(), "n1's fetch had finished before it was cut off"
        control.proxy.rate = None  # n2's copy may finish now

        def all_on_n2():
            placed_at_most("tiny", 2, seen)
            placed_at_most("late", 2, seen)
            replicas = ready("tiny") + ready("late")
            return len(replicas) == 4 and all(r.node.name == "n2" for r in replicas)

        wait_until(all_on_n2, 240, what=lambda: f"n1's replicas on n2: {state([n1, n2])}")
        answered_more(asker, 11)  # and answered once all four are on n2: more than ten after the cut
    # Every request answered: those sent to n1 after the cut (on a kept-alive connection,
    # which no connect timeout guards) and the one n1 had when its link went down, too.
    after_cut = [o for o in asker.outcomes if o[0] >= cut_at]
    assert len(after_cut) > 10, asker.outcomes
    failed = asker.failures()
    assert not failed, f"{len(failed)} of {len(asker.outcomes)} requests failed: {failed[:3]}"
    assert sorted(n2.engines().values()) == ["late", "late", "tiny", "tiny"]


def test_a_node_that_comes_back_stops_its_old_engines_and_the_gateway_never_routes_to_them(engine_fleet, client_key):
    control, (n1, n2) = engine_fleet
    # n1 comes back empty-handed first (its processes were killed), and takes work again.
    n1.host.restore()
    n1.start_agent()
    wait_until(
        lambda: NodeRow.objects.get(name="n1").state == NodeRow.State.READY, timeout=30, what="n1 back and ready"
    )
    # Whatever its supervisor started again from its state file is told to stop: those replicas are n2's now.
    wait_until(lambda: not n1.engines(), 60, what=lambda: f"n1 to run nothing: {state([n1, n2])}")
    # Now n2 is cut off with its engines running: only its agent is killed, as a host
    # whose network and agent fail while its engines go on.
    stale = n2.engines()
    assert sorted(stale.values()) == ["late", "late", "tiny", "tiny"]
    stale_ids = list(Replica.objects.filter(node__name="n2").values_list("pk", flat=True))
    n2.host.cut()
    n2.kill_agent()
    seen: list[int] = []

    def all_on_n1():
        placed_at_most("tiny", 2, seen)
        placed_at_most("late", 2, seen)
        replicas = ready("tiny") + ready("late")
        return len(replicas) == 4 and all(r.node.name == "n1" for r in replicas)

    wait_until(all_on_n1, 240, what=lambda: f"n2's replicas on n1: {state([n1, n2])}")
    assert set(stale) <= set(n2.engines()), "n2's engines stopped while it was cut off: nothing left to come back"
    routed(control, client_key)
    before = {replica_id: chat_requests_in(n2.engine_log(replica_id)) for replica_id in stale_ids}

    with Asker(control.gateway_urls, client_key, {"model": "tiny", **ASK}) as asker:
        n2.host.restore()
        n2.start_agent()

        def stale_gone():
            placed_at_most("tiny", 2, seen)
            placed_at_most("late", 2, seen)
            return not n2.engines()

        wait_until(stale_gone, 120, what=lambda: f"n2 to stop its old engines: {state([n1, n2])}")
        answered_more(asker, 5)  # and answered once they are gone
    after = {replica_id: chat_requests_in(n2.engine_log(replica_id)) for replica_id in stale_ids}
    assert after == before, f"the gateway sent requests to n2's stale engines: {before} then {after}"
    assert not asker.failures(), f"{len(asker.failures())} of {len(asker.outcomes)} failed: {asker.failures()[:3]}"
    assert sorted(n1.engines().values()) == ["late", "late", "tiny", "tiny"]
    assert Replica.objects.filter(model_name="tiny").count() == 2


def test_the_control_plane_killed_and_started_again_while_replicas_serve_answers_every_request_and_places_nothing_twice(
    engine_fleet, client_key
):
    control, nodes = engine_fleet
    engines_before = {n.name: n.engines() for n in nodes}
    rows_before = sorted(Replica.objects.values_list("pk", "model_name", "node__name", "endpoint", "state"))
    assert len(rows_before) == 4 and all(row[4] == "ready" for row in rows_before), rows_before
    routed(control, client_key)
    with Asker(control.gateway_urls, client_key, {"model": "tiny", **ASK}) as asker:
        answered_more(asker, 5)  # asking before anything is killed
        # Everything but one gateway, at once: control worker and beat, byte listener,
        # Redis, the admin server, gateway 0.
        for process in (control.worker, control.byte_listener, control.admin, control.gateways[0]):
            process.kill()
        control.redis.kill()
        control.redis.wait(timeout=10)
        time.sleep(3)  # a fixed pause on purpose: the control plane stays down a while, as in an outage
        control.start_redis()
        control.start_byte_listener()
        control.start_worker()
        control.start_admin()
        control.start_gateway(0)
        # Reconcile passes on the new worker, with the nodes' reports of what they run: five
        # seconds of reports the new worker collected (a heartbeat and a pass a second) to prove
        # an absence, that none of them places anything again. Polled, not slept: a worker slow
        # to start under load still gets its five seconds of passes.
        collecting_from = timezone.now() + datetime.timedelta(seconds=5)
        wait_until(
            lambda: NodeRow.objects.filter(last_heartbeat__gte=collecting_from).count() == len(nodes),
            120,
            what=lambda: f"five seconds of heartbeats the new worker collected: {state(nodes)}",
        )
        control.gateways[1].kill()
        time.sleep(3)  # a fixed pause on purpose: gateway 1 stays down a while, the other answering
        control.start_gateway(1)
        answered_more(asker, 10)  # and answered once everything is back
    assert len(asker.outcomes) > 20, asker.outcomes
    assert not asker.failures(), f"{len(asker.failures())} of {len(asker.outcomes)} failed: {asker.failures()[:3]}"
    # Both gateways answered in turn, the restarted ones included.
    rows_after = sorted(Replica.objects.values_list("pk", "model_name", "node__name", "endpoint", "state"))
    assert rows_after == rows_before
    assert {n.name: n.engines() for n in nodes} == engines_before
