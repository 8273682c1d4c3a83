"""No errors while a model's only replica changes, on the real agent and the real engine.

- A request that arrives while the model's profile is being rolled over (its old replica
  stopped, the new one starting) waits and is answered.
- Streamed requests sent right after the only replica's engine is killed (SIGKILL) wait for
  the agent to start it again and are all answered 200, none 502 or 503.
  With LLMGW_HOLD_S=0 (no holding: the gateway before issue 14) these two fail, with a 503
  and with 502s.
- Streams in flight on a replica being replaced finish whole: it is drained before its
  engine is stopped (fleet/drain.py; 3 of 16 were cut before).
- A model back at zero soon after a wake is woken again at once (its wake key was left
  for 30 s before).

A beat is played by the test: `fleet.reconcile` sent on the control queue every second,
where a real Celery control worker runs it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading

import pytest
import requests
from celery import current_app

from agent import engine_state, engines
from catalog.models import Model, Profile
from contracts import tasks
from fleet.enrolment import issue_token
from fleet.models import Node, Replica
from gateway.keys import create_key

from . import real_model
from .real_model import MODEL, ask, assert_chat_answer, streamed_whole
from .support.gateway import until_routed
from .support.mirror import settle
from .support.processes import start_agent
from .support.waiting import wait_until

pytestmark = [pytest.mark.engine, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def agent_with_real_weights(tmp_path, mirror_root, byte_listener, control_worker, settings):
    """One real agent (n1) with its engine supervisor, the weights in the mirror: (source, cache)."""
    weights = real_model.gguf()
    version = mirror_root / MODEL / "instruct-q4_1"
    version.mkdir(parents=True)
    shutil.copyfile(weights, version / weights.name)
    settle(version)  # copied in a while ago: whole, not still being written (LLMGW_MIRROR_SETTLE_S)
    settings.BYTES_URL = byte_listener
    cache = tmp_path / "cache-n1"
    agent = start_agent("n1", issue_token("n1"), cache, tmp_path, LLMGW_BYTES_URL=byte_listener)
    wait_until(
        lambda: "llamacpp" in (Node.objects.filter(name="n1").values_list("engines", flat=True).first() or []),
        timeout=120,
        interval=0.5,
        what="n1's heartbeat with llamacpp",
    )
    yield f"{byte_listener}{MODEL}/instruct-q4_1/{weights.name}", cache
    agent.stop()
    for entry in engine_state.read_state(cache)["replicas"].values():
        if entry.get("pid") and engines.group_alive(entry["pid"]):
            engines.stop_group(entry["pid"], grace=3)


@pytest.fixture
def beat():
    """fleet.reconcile every second, as the beat sends it (settings.CELERY_BEAT_SCHEDULE, sooner)."""
    stop = threading.Event()

    def run():
        while not stop.wait(1.0):
            current_app.send_task(tasks.RECONCILE, queue=tasks.CONTROL_QUEUE)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    yield
    stop.set()
    thread.join(5)


def serve(source: str, memory_gb: int = 0) -> Profile:
    model = Model.objects.create(name=MODEL, source=source, context_length=2048, scaling_min=1, scaling_max=1)
    return Profile.objects.create(
        model=model, name="cpu", engine="llamacpp", args=["--ctx-size", "2048"], min_memory_gb=memory_gb
    )


def ready_replica(timeout: float = 240) -> Replica:
    return wait_until(
        lambda: Replica.objects.filter(model_name=MODEL, state="ready").select_related("node").first(),
        timeout=timeout,
        interval=0.3,
        what=f"a ready replica of {MODEL}: {list(Replica.objects.values('id', 'state', 'reason'))}",
    )


def streamed(url: str, secret: str, question: str = real_model.QUESTION) -> tuple[int, list[str]]:
    """(status, lines) of a streamed chat through the gateway."""
    body = {"model": MODEL, **ask(question, max_tokens=16), "stream": True, "stream_options": {"include_usage": True}}
    with requests.post(
        url + "/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {secret}"},
        stream=True,
        timeout=300,
    ) as response:
        if response.status_code != 200:
            return response.status_code, [response.text]
        return 200, list(response.iter_lines(decode_unicode=True))


def whole_answer(lines: list[str]) -> str:
    """The text of a streamed answer that ended well: no error event, [DONE] at its end."""
    events = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
    errors = [e for e in events if e.startswith("{") and "error" in json.loads(e)]
    assert not errors, errors
    text, usage, _ = streamed_whole(events)
    assert usage and usage["completion_tokens"] > 0, events[-3:]
    return text


def test_a_request_arriving_during_a_rolling_replacement_waits_and_is_answered(agent_with_real_weights, gateway, beat):
    source, cache = agent_with_real_weights
    # The profile asks for more than half the node's memory: the old replica holds the room the
    # new one needs, so it is stopped first (fleet/placement/stopping.py, retire) and the model has no
    # ready replica until the new one has started; the widest gap a rolling replacement leaves.
    half = Node.objects.get(name="n1").memory_gb // 2 + 1
    profile = serve(source, memory_gb=half)
    old = ready_replica()
    _, secret = create_key("k")
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {secret}"
    until_routed(session, gateway.url, MODEL)
    assert streamed(gateway.url, secret)[0] == 200
    old_pid = engine_state.read_state(cache)["replicas"][str(old.pk)]["pid"]

    profile.args = ["--ctx-size", "1024"]
    profile.save()  # queues fleet.reconcile (fleet/signals.py): the old replica is outdated
    # Its engine stopped, the row gone (the agent reported it stopped): from here until the new
    # replica is ready, a request has nowhere to go but the queue.
    wait_until(
        lambda: not Replica.objects.filter(pk=old.pk).exists(),
        timeout=60,
        what="the outdated replica to be stopped",
    )
    assert not engines.group_alive(old_pid)
    assert not Replica.objects.filter(model_name=MODEL, state="ready").exists(), "no gap: nothing to wait through"
    results: dict[str, tuple[int, list[str]]] = {}

    def plain():
        answer = session.post(gateway.url + "/v1/chat/completions", json={"model": MODEL, **ask()}, timeout=300)
        results["plain"] = (answer.status_code, [answer.text])

    threads = [
        threading.Thread(target=lambda: results.__setitem__("streamed", streamed(gateway.url, secret)), daemon=True),
        threading.Thread(target=plain, daemon=True),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)

    status, lines = results["streamed"]
    assert status == 200, lines
    assert real_model.ANSWER in whole_answer(lines)
    status, (text,) = results["plain"]
    assert status == 200, text
    assert_chat_answer(json.loads(text))
    new = ready_replica()
    assert new.pk != old.pk and new.args == ["--ctx-size", "1024", "--parallel", "1"]
    wait_until(lambda: not Replica.objects.filter(pk=old.pk).exists(), timeout=60, what="the old replica to go")


def test_streamed_requests_sent_right_after_the_only_engine_is_killed_are_all_answered(
    agent_with_real_weights, gateway, beat
):
    source, cache = agent_with_real_weights
    serve(source)
    replica = ready_replica()
    _, secret = create_key("k")
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {secret}"
    until_routed(session, gateway.url, MODEL)
    assert streamed(gateway.url, secret)[0] == 200
    pid = engine_state.read_state(cache)["replicas"][str(replica.pk)]["pid"]

    os.killpg(pid, signal.SIGKILL)
    results: dict[int, tuple[int, list[str]]] = {}

    def one(n: int) -> None:
        results[n] = streamed(gateway.url, secret, f"Say the number {n}.")

    threads = [threading.Thread(target=one, args=(n,), daemon=True) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)

    statuses = {n: status for n, (status, _) in results.items()}
    assert statuses == dict.fromkeys(range(6), 200), {n: r for n, r in results.items() if r[0] != 200}
    for _, lines in results.values():
        whole_answer(lines)
    # Answered by the same replica, its engine started again by the agent (a new process).
    again = ready_replica()
    assert again.pk == replica.pk
    assert engine_state.read_state(cache)["replicas"][str(replica.pk)]["pid"] != pid


def test_streams_in_flight_on_a_replica_being_replaced_finish_whole(agent_with_real_weights, gateway, beat):
    """Room for both: the old replica serves until the new one is ready, then is drained, then stopped.

    Before fleet/drain.py its engine was stopped the moment the new one was ready, and the
    streams it was answering ended with an error event (PyPI's llama.cpp server ends them on
    SIGTERM).
    """
    source, cache = agent_with_real_weights
    profile = serve(source)
    old = ready_replica()
    _, secret = create_key("k")
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {secret}"
    until_routed(session, gateway.url, MODEL)
    results: list[tuple[int, list[str]]] = []
    done = threading.Event()

    def client(n: int) -> None:
        while not done.is_set():
            results.append(streamed(gateway.url, secret, f"Count from 1 to 30, client {n}."))

    threads = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(4)]
    for thread in threads:
        thread.start()
    wait_until(lambda: len(results) >= 2, timeout=60, what="answers before the edit")

    profile.args = ["--ctx-size", "1024"]
    profile.save()
    wait_until(lambda: not Replica.objects.filter(pk=old.pk).exists(), timeout=240, what="the old replica to go")
    # A little longer: whatever was on its way to the old replica has ended by now.
    wait_until(lambda: len(results) >= 12, timeout=120, what="answers after the replacement")
    done.set()
    for thread in threads:
        thread.join(120)

    assert {status for status, _ in results} == {200}, [r for r in results if r[0] != 200][:2]
    # A cut stream shows its error events (or, with none, its last lines).
    cut = [
        [x for x in lines if '"error"' in x] or lines[-3:]
        for _, lines in results
        if "data: [DONE]" not in lines or any('"error"' in x for x in lines)
    ]
    assert not cut, f"{len(cut)} of {len(results)} streams cut: {cut[:2]}"
    assert ready_replica().args == ["--ctx-size", "1024", "--parallel", "1"]


def test_a_model_back_at_zero_soon_after_a_wake_is_woken_again_at_once(tmp_path, gateway, redis_client):
    """The first waiting request's wake key (SET NX, 30 s) is cleared once the model has a replica.

    Before, a model woken and back at zero within 30 s (a short idle time, an engine lost)
    was not asked for again until the key expired: bench/wake.py's requests each waited 30 s.
    No control worker here: the test plays the control plane (it adds and removes the replica)
    and reads the gateway's asks from its log.
    """
    process, endpoint, _ = real_model.start_engine(real_model.gguf(), tmp_path)
    try:
        model = Model.objects.create(
            name=MODEL, source="http://127.0.0.1:1/smollm2/", context_length=2048, scaling_min=0, scaling_max=1
        )
        Profile.objects.create(model=model, name="cpu", engine="llamacpp")
        node = Node.objects.create(name="n1")
        _, secret = create_key("k")
        asks = "asked the control plane to wake"

        for round_ in (1, 2):
            box = {}
            thread = threading.Thread(target=lambda box=box: box.setdefault("answer", streamed(gateway.url, secret)))
            thread.start()
            wait_until(
                lambda round_=round_: gateway.process.output().count(asks) == round_,
                timeout=10,
                what=f"wake {round_} to be asked for at once: {gateway.process.output().count(asks)} asked",
            )
            replica = Replica.objects.create(
                model_name=MODEL, profile_name="cpu", node=node, state="ready", endpoint=endpoint
            )
            thread.join(120)
            assert box["answer"][0] == 200, box
            whole_answer(box["answer"][1])
            replica.delete()  # back at zero, well within 30 s of the wake
            wait_until(
                lambda: streamed_status_is_waiting(gateway.url, secret), timeout=10, what="the gateway to see zero"
            )
    finally:
        engines.stop_group(process.pid, grace=3)
        process.wait(timeout=10)


def streamed_status_is_waiting(url: str, secret: str) -> bool:
    """Whether /v1/models says the model is not ready (it can wake)."""
    models = requests.get(url + "/v1/models", headers={"Authorization": f"Bearer {secret}"}, timeout=10).json()
    return any(m["id"] == MODEL and not m["ready"] for m in models["data"])
