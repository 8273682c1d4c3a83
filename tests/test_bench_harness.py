"""bench/harness: contenders in rotating order, medians, the goals' lines, and the servers it stops."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from harness import Goal, Servers, best, medians, report, rotation, side_by_side  # noqa: E402

from tests.support.waiting import wait_until  # noqa: E402


def test_each_contender_goes_first_once_in_as_many_rounds():
    names = ["a", "b", "c"]
    orders = [rotation(names, round_) for round_ in range(4)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


def test_side_by_side_keeps_repeat_samples_of_each_after_the_warmup_and_rotates_who_runs_first():
    calls: list[str] = []

    def contender(name: str):
        def measure() -> float:
            calls.append(name)
            return float(len(calls))

        return measure

    samples = side_by_side({"x": contender("x"), "y": contender("y")}, repeat=3, warmup=1)
    assert calls == ["x", "y", "y", "x", "x", "y", "y", "x"]
    assert samples == {"x": [4.0, 5.0, 8.0], "y": [3.0, 6.0, 7.0]}


def test_medians_reduce_plain_samples_and_each_figure_of_dict_samples():
    figures = medians({"plain": [3.0, 1.0, 2.0], "dicts": [{"a": 1, "b": 10}, {"a": 3, "b": 30}, {"a": 2, "b": 20}]})
    assert figures == {"plain": 2.0, "dicts": {"a": 2, "b": 20}}
    assert best({"x": [{"rps": 5}, {"rps": 9}, {"rps": 7}]}, key=lambda s: s["rps"]) == {"x": {"rps": 9}}


def test_report_says_met_or_not_met_and_leaves_out_a_goal_whose_contender_did_not_run(capsys):
    goals = [
        Goal("fast enough", lambda f: f["llmgw"] < 2),
        Goal("faster than LiteLLM", lambda f: f["llmgw"] < f["LiteLLM"]),
        Goal("under one", lambda f: f["llmgw"] < 1),
    ]
    assert report(goals, {"llmgw": 1.5}) is False
    assert capsys.readouterr().out.splitlines() == ["met      fast enough", "NOT met  under one"]


def test_servers_stop_every_process_group_even_one_that_ignores_sigterm_and_remove_the_work_directory():
    with Servers("llmgw-test-harness-") as servers:
        work = servers.work
        # The child of a shell: a process group's member the harness never saw, stopped with it.
        calm = servers.spawn(["sh", "-c", "sleep 600 & wait"], "calm")
        stubborn = servers.spawn(["sh", "-c", "trap '' TERM; echo ready; sleep 600 & wait"], "stubborn")
        wait_until(lambda: "ready" in servers.log_tail("stubborn"), timeout=30, what="the stubborn shell's trap")
        Servers.stop(stubborn, grace=0.5)
        assert stubborn.poll() is not None
    assert calm.poll() is not None
    assert not work.exists()
    # Zombies left to an init that does not reap are not running: only a live member counts.
    members = subprocess.run(["ps", "-o", "stat=", "-g", str(calm.pid)], capture_output=True, text=True).stdout
    assert [state for state in members.split() if not state.startswith("Z")] == []


@pytest.mark.processes  # it starts `sleep` and `sh` and stops them
def test_servers_leave_on_an_exception_with_nothing_running_and_give_back_the_sigterm_handler():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RuntimeError), Servers("llmgw-test-harness-") as servers:
        process = servers.spawn(["sleep", "600"], "sleeper")
        raise RuntimeError("the run failed")
    assert process.poll() is not None
    assert signal.getsignal(signal.SIGTERM) is before
