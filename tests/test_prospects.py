"""Which models a request waits for, and what a waiting client is told: gateway/prospects.py's rules."""

from gateway.prospects import CAN_WAKE, CANNOT, ReplicaRow, judge


def row(id=1, state="pending", reason="", attempts=0, node="n1", alive=True, percent=None) -> ReplicaRow:
    return ReplicaRow(id, state, reason, attempts, node, alive, percent)


def test_a_model_at_zero_can_wake_and_one_whose_most_is_zero_cannot():
    assert judge("m", 0, 1, [], set()).state == CAN_WAKE
    assert judge("m", 0, 1, [], set()).status == "scaled to zero, waking"
    off = judge("m", 0, 0, [], set())
    assert off.state == CANNOT and off.reason == "m may run no replica (its most is 0)"
    assert judge("m", None, None, [], set()).state == CANNOT  # gone from the catalog


def test_the_replica_nearest_to_ready_is_what_a_waiting_client_is_told():
    coming = [row(1, "pending", "no node has room"), row(2, "fetching", percent="43%"), row(3, "starting")]
    prospect = judge("m", 1, 3, coming, set())
    assert prospect.state == CAN_WAKE and prospect.status == "starting"
    assert prospect.reason == (
        "No replica of m is ready: replica 3 on n1 is starting; replica 2 on n1 is fetching 43%; "
        "replica 1 on n1 is pending: no node has room"
    )
    assert judge("m", 1, 3, coming[:2], set()).status == "fetching 43%"


def test_a_replica_that_crashed_is_waited_for_until_it_failed_three_times_in_a_row():
    crashed = "the engine exited with code 9; starting it again in 1 s. Its last lines:\n..."
    assert judge("m", 1, 1, [row(state="failed", reason=crashed, attempts=1)], set()).state == CAN_WAKE
    hopeless = judge("m", 1, 1, [row(state="failed", reason=crashed, attempts=3)], set())
    assert hopeless.state == CANNOT
    assert "replica 1 on n1 failed 3 times in a row: the engine exited with code 9" in hopeless.reason


def test_a_routed_replica_that_does_not_answer_or_whose_node_is_lost_is_waited_for():
    assert judge("m", 1, 1, [row(state="ready")], {1}).status == "replica 1 does not answer"
    assert judge("m", 1, 1, [row(state="ready", alive=False)], {1}).status == "node n1 lost"
    assert judge("m", 1, 1, [row(state="ready")], set()).status == "ready, being routed"
