"""A wake waits for no turn of the supervisor's loop (issue 39): a start is acted on when a task
wants it, and a starting engine's readiness is seen as it comes, not at the next half second.

The loop here is given an hour between its ordinary looks, so anything it does within the test's
deadline it did because a task poked it (engine_state.poke) or because an engine was starting.
"""

from __future__ import annotations

import threading

import pytest

from agent import engine_state, engines, supervisor

from .support.engines import Reports
from .support.waiting import wait_until

HOUR = 3600.0


@pytest.fixture
def running(tmp_path):
    cache = tmp_path / "cache"
    reports = Reports()
    sup = supervisor.Supervisor(cache, reports)
    stop = threading.Event()
    loop = threading.Thread(target=sup.run, args=(stop,), kwargs={"interval": HOUR}, daemon=True)
    loop.start()
    wait_until(lambda: engine_state.waker_path(cache).exists(), timeout=10, what="the supervisor's socket")
    yield cache, reports
    stop.set()
    engine_state.poke(cache)  # out of its hour-long wait
    loop.join(timeout=30)
    for entry in engine_state.read_state(cache)["replicas"].values():
        if entry.get("pid"):
            engines.stop_group(entry["pid"], grace=2)


@pytest.mark.engine
def test_a_wanted_engine_is_started_and_seen_ready_without_waiting_for_the_loops_next_turn(
    running, tiny_gguf, engine_cleanup
):
    cache, reports = running
    engine_state.want(cache, 1, "llamacpp", "http://mirror/tiny/v1/", tiny_gguf, ["--ctx-size", "256"], "tiny")
    # The start: only the poke can have woken a loop that waits an hour.
    wait_until(lambda: "starting" in reports.states(), timeout=30, what="the start, made on the poke")
    # Ready: the engine answered after the start, and only the starting engine's quick looks see it.
    wait_until(lambda: "ready" in reports.states(), timeout=120, what="llama.cpp's readiness, seen as it came")
    assert reports.states() == ["starting", "ready"]
    # And a stop is made on its poke too.
    assert engine_state.unwant(cache, 1)
    wait_until(lambda: reports.states()[-1] == "stopped", timeout=30, what="the stop, made on the poke")


def test_a_poke_with_no_supervisor_listening_is_nothing(tmp_path):
    engine_state.poke(tmp_path / "nowhere")  # no socket, no directory: no error
