"""On demand, on the real agent and the real engine: wake from zero, idle to zero, load between
fewest and most, and making room.

The gateway's half (counting load, holding requests, sending the wake) is another part's;
here the test plays the gateway the way contracts/demand.py says it does: it writes load
snapshots into Redis with `demand.encode` and sends `fleet.wake` on the control queue,
where a real Celery control worker runs it. Reconcile passes that a beat would run are run
from the test, so each step happens when the test says.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import time

import pytest
import requests
from celery import current_app

from agent import engine_state, engines
from agent.sources import cache_path
from catalog.models import Model, Profile
from contracts import demand, keys, tasks
from fleet import autoscale, reconcile
from fleet.enrolment import issue_token
from fleet.live import redis_client
from fleet.models import Node, Replica, Scale

from . import real_model
from .real_model import MODEL, ask
from .staff_api import token_session
from .support.mirror import settle
from .support.processes import CountingProxy, engine_secret, start_agent
from .support.waiting import wait_until

pytestmark = [pytest.mark.engine, pytest.mark.django_db(transaction=True)]

GATEWAY = "test-gateway"


@pytest.fixture(autouse=True)
def nothing_queued_from_another_test():
    redis_client().delete(
        "unacked",
        "unacked_index",
        *keys.unacked_keys("n1").values(),
        *keys.unacked_keys("n2").values(),
        "node.n1",
        "node.n2",
        demand.LOAD_KEY,
        autoscale.TIMES_KEY,
    )


@pytest.fixture
def real_model_proxy(mirror_root, byte_listener, settings):
    """The byte listener behind a proxy that counts every request a node makes of it, the real model in the mirror."""
    weights = real_model.gguf()
    version = mirror_root / MODEL / "instruct-q4_1"
    version.mkdir(parents=True)
    shutil.copyfile(weights, version / weights.name)
    settle(version)  # copied in a while ago: whole, not still being written (LLMGW_MIRROR_SETTLE_S)
    counting = CountingProxy(byte_listener)
    counting.source = f"{counting.url}{MODEL}/instruct-q4_1/{weights.name}"
    settings.BYTES_URL = counting.url
    yield counting
    counting.stop()


class Agents(dict):
    @contextlib.contextmanager
    def held(self):
        """Agents that take no task meanwhile (SIGSTOP): a stopping replica stays to be read, not
        deleted by its node's `stopped` a moment later."""
        for process, _ in self.values():
            os.kill(process.popen.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            for process, _ in self.values():
                os.kill(process.popen.pid, signal.SIGCONT)

    def stop(self) -> None:
        for process, cache in self.values():
            process.stop()
            for entry in engine_state.read_state(cache)["replicas"].values():
                if entry.get("pid") and engines.group_alive(entry["pid"]):
                    engines.stop_group(entry["pid"], grace=3)


def agents_for(names, real_model_proxy, tmp_path) -> Agents:
    agents = Agents()
    for name in names:
        cache = tmp_path / f"cache-{name}"
        agents[name] = (
            start_agent(name, issue_token(name), cache, tmp_path, LLMGW_BYTES_URL=real_model_proxy.url),
            cache,
        )

    def enrolled():
        nodes = Node.objects.filter(name__in=names)
        return len(nodes) == len(names) and all(n.state == "ready" and "llamacpp" in n.engines for n in nodes)

    wait_until(enrolled, timeout=120, interval=0.5, what="the agents' heartbeats with llamacpp")
    return agents


@pytest.fixture
def two_nodes(real_model_proxy, control_worker, tmp_path):
    agents = agents_for(["n1", "n2"], real_model_proxy, tmp_path)
    yield agents
    agents.stop()


@pytest.fixture
def one_node(real_model_proxy, control_worker, tmp_path):
    agents = agents_for(["n1"], real_model_proxy, tmp_path)
    yield agents
    agents.stop()


def serve(name: str, source: str, memory_gb: int = 0, **scaling) -> Model:
    model = Model.objects.create(name=name, source=source, context_length=2048, **scaling)
    Profile.objects.create(
        model=model, name="cpu", engine="llamacpp", args=["--ctx-size", "2048"], min_memory_gb=memory_gb
    )
    return model


def gateway_load(models: dict[str, tuple[int, int, float]] | None = None, replicas: dict[int, int] | None = None):
    """What a gateway process writes about once a second: {model: (in flight, waiting, last request)}."""
    snapshot = {
        "at": time.time(),
        "models": {m: {"in_flight": f, "waiting": w, "last_request": t} for m, (f, w, t) in (models or {}).items()},
        "replicas": {str(r): n for r, n in (replicas or {}).items()},
    }
    redis_client().hset(demand.LOAD_KEY, GATEWAY, demand.encode(snapshot))


def one_pass(**load) -> None:
    """A reconcile pass as the beat runs it, with the gateway's load as the test says it is now."""
    gateway_load(**load)
    wait_until(lambda: reconcile.reconcile() is not None, timeout=30, what="the reconcile lock")


def wake(model: str) -> None:
    """What the gateway's first waiting request sends (contracts/demand.py)."""
    current_app.send_task(demand.WAKE, args=[model], queue=tasks.CONTROL_QUEUE)


def ready(model: str, count: int = 1, timeout: float = 240) -> list[Replica]:
    def enough():
        rows = list(Replica.objects.filter(model_name=model, state="ready").select_related("node"))
        return rows if len(rows) >= count else None

    return wait_until(
        enough,
        timeout=timeout,
        interval=0.3,
        what=f"{count} ready replica(s) of {model}: {list(Replica.objects.values('model_name', 'state', 'reason'))}",
    )


def first_token_seconds(replica: Replica) -> float:
    endpoint = replica.endpoint
    started = time.monotonic()
    body = {"model": MODEL, **ask(max_tokens=8), "stream": True}
    with requests.post(
        endpoint + "/chat/completions", json=body, headers=engine_secret(replica), stream=True, timeout=120
    ) as response:
        assert response.status_code == 200, response.text
        for line in response.iter_lines(decode_unicode=True):
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[len("data: ") :])
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    return time.monotonic() - started
    raise AssertionError("the stream ended without a token")


def test_a_model_idle_past_its_time_goes_to_zero_keeps_its_cache_and_wakes_where_the_weights_are(
    two_nodes, real_model_proxy
):
    # n1 is draining for the first start, so the weights land on n2 only; n1 would win a tie by name.
    Node.objects.filter(name="n1").update(draining=True)
    serve(MODEL, real_model_proxy.source, scaling_min=0, scaling_max=1, idle_s=3)
    one_pass()
    assert Replica.objects.count() == 0, "a model whose fewest is 0 starts with no replica"

    wake(MODEL)
    (replica,) = ready(MODEL)
    assert (replica.node.name, replica.cause) == ("n2", "woken by a request")
    assert any(method == "GET" for method, _, _ in real_model_proxy.requests), "the first start fetched the weights"
    Node.objects.filter(name="n1").update(draining=False)

    # No request for longer than its idle time: the last replica stops, and says why.
    with two_nodes.held():
        wait_until(lambda: one_pass() or Replica.objects.filter(state="stopping").exists(), timeout=30, interval=0.5)
        stopping = Replica.objects.get()
        assert (stopping.state, stopping.reason) == ("stopping", "idle 3 s")
    assert Scale.objects.get(model_name=MODEL).why == "idle 3 s"
    wait_until(lambda: not Replica.objects.exists(), timeout=60, what="the stopped report")
    _, cache_n2 = two_nodes["n2"]
    wait_until(lambda: not engine_state.running_engines(cache_n2), timeout=30, what="the engine to be stopped")
    assert cache_path(real_model_proxy.source, cache_n2).stat().st_size == real_model.gguf().stat().st_size
    one_pass()
    assert not Replica.objects.exists(), "an idle model stays at zero"

    # A request for it wakes it on n2, which has the weights: an engine start, no download.
    real_model_proxy.reset_counts()
    wake(MODEL)
    (replica,) = ready(MODEL)
    assert replica.node.name == "n2"
    # The cached set is checked against the manifest (one small GET, docs/agent.md), no file fetched again
    # (the node's tracker announces of what it seeds, which fetch nothing, are the proxy's `announces`).
    fetched = [path for _, path, _ in real_model_proxy.requests]
    assert all(path.endswith("/") for path in fetched), f"the wake downloaded: {real_model_proxy.requests}"
    assert first_token_seconds(replica) < 60


def test_load_above_target_adds_replicas_up_to_most_and_quiet_removes_them_one_at_a_time_never_a_busy_one(
    two_nodes, real_model_proxy
):
    serve(MODEL, real_model_proxy.source, scaling_min=1, scaling_max=3, target_load=2, quiet_s=2)
    (first,) = ready(MODEL)
    assert first.cause == "fewest"

    # Five in flight at two per replica need three; nine would need five, and most is three.
    now = time.time()
    one_pass(models={MODEL: (5, 0, now)}, replicas={first.pk: 5})
    assert Replica.objects.filter(model_name=MODEL).count() == 3
    assert set(Replica.objects.exclude(pk=first.pk).values_list("cause", flat=True)) == {"load"}
    one_pass(models={MODEL: (9, 0, now)}, replicas={first.pk: 9})
    assert Replica.objects.filter(model_name=MODEL).count() == 3, "never more than most"
    assert Scale.objects.get(model_name=MODEL).replicas == 3
    # The load falls at once, but the quiet period has not passed: nothing stops yet.
    one_pass(models={MODEL: (0, 0, now)})
    assert not Replica.objects.filter(state="stopping").exists()
    ready(MODEL, 3)

    # One request in flight, on the replica placement would otherwise stop first (the newest).
    busy = Replica.objects.filter(model_name=MODEL).latest("pk")
    load = {"models": {MODEL: (1, 0, time.time())}, "replicas": {busy.pk: 1}}
    stops: list[tuple[int, str, float]] = []

    def next_stop():
        with two_nodes.held():
            one_pass(**load)
            found = [r for r in Replica.objects.filter(state="stopping") if r.pk not in {s[0] for s in stops}]
        if len(found) > 1:
            raise AssertionError(f"two stopped in one pass: {found}")
        if found:
            stops.append((found[0].pk, found[0].reason, time.monotonic()))
        return found

    for _ in range(2):
        wait_until(next_stop, timeout=30, interval=0.3, what="a replica stopped after the quiet period")
    assert [reason for _, reason, _ in stops] == ["quiet 2 s", "quiet 2 s"]
    assert stops[1][2] - stops[0][2] >= 1.5, "the second stopped before another quiet period"
    assert busy.pk not in {pk for pk, _, _ in stops}
    # Passes as the beat runs them: with a request in flight on the model, a stopped replica
    # drains (fleet/drain.py) and its node is told by a later pass.
    wait_until(
        lambda: one_pass(**load) or Replica.objects.filter(model_name=MODEL).count() == 1,
        timeout=60,
        interval=0.5,
        what="the stopped reports",
    )

    # Quiet for longer still: never below fewest, and the one left is the busy one.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        one_pass()
        time.sleep(0.5)  # passes for five seconds, proving an absence: no replica below fewest
    assert list(Replica.objects.values_list("pk", "state")) == [(busy.pk, "ready")]


def test_making_room_stops_an_idle_model_and_says_so_but_never_a_busy_one(one_node, real_model_proxy, live_server):
    staff = token_session()
    whole_node = Node.objects.get(name="n1").memory_gb
    serve("room-a", real_model_proxy.source, memory_gb=whole_node, scaling_min=0, scaling_max=1)
    serve("room-b", real_model_proxy.source, memory_gb=whole_node, scaling_min=0, scaling_max=1)
    wake("room-a")
    (a,) = ready("room-a")

    # room-a answers a request: room-b, woken, waits, and room-a is not touched.
    now = time.time()
    busy = {"models": {"room-a": (1, 0, now), "room-b": (0, 1, now)}, "replicas": {a.pk: 1}}
    gateway_load(**busy)
    wake("room-b")
    wait_until(lambda: Replica.objects.filter(model_name="room-b").exists(), timeout=30, what="room-b's replica")
    for _ in range(3):
        one_pass(**busy)
    assert Replica.objects.get(pk=a.pk).state == "ready"
    b = Replica.objects.get(model_name="room-b")
    assert (b.state, b.node) == ("pending", None)
    assert f"n1: 0 GB free, needs {whole_node}" in b.reason

    # room-a is idle now: it is stopped to make room, and room-b is started in its place.
    with one_node.held():
        one_pass(models={"room-a": (0, 0, now), "room-b": (0, 1, time.time())})
        a.refresh_from_db()
        freed = f"stopped to make room for room-b: frees {whole_node} GB on n1"
        assert (a.state, a.reason) == ("stopping", freed)
        shown = staff.get(live_server.url + f"/api/fleet/replicas/{a.pk}/").json()
        assert shown["reason"] == freed
        b.refresh_from_db()
        assert b.reason == "waiting for room on n1: stopping idle replicas of room-a"
    (placed,) = ready("room-b")
    # The row that waited for room is the one started: the same replica, added for the wake.
    assert (placed.pk, placed.node.name, placed.cause) == (b.pk, "n1", "woken by a request")
    assert not Replica.objects.filter(model_name="room-a").exists()
    assert (Scale.objects.get(model_name="room-a").replicas, Scale.objects.get(model_name="room-b").replicas) == (0, 1)
