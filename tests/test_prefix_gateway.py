"""Prefix routing in the gateway process against fake replicas: the faults an engine cannot be made to show on cue."""

from __future__ import annotations

import time

import pytest

from contracts import demand
from gateway import prefix
from gateway.keys import create_key
from gateway.routes import Upstream

from .support.factories import add_model, add_replica
from .support.gateway import chat, client, until_routed
from .support.gateway_process import start_gateway
from .support.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_connection_the_engine_closed_as_it_was_taken_is_tried_again_on_the_same_replica_not_another(
    gateway, replicas
):
    add_model()
    first, second = replicas("first"), replicas("second")
    made = {add_replica("chat", r.base).pk: r for r in (first, second)}
    _, secret = create_key("k")
    session = client(secret)
    until_routed(session, gateway.url)
    ring = prefix.Ring(tuple(Upstream(pk, "", 1) for pk in sorted(made)))
    owner = ring.owner(prefix.key_of({"messages": [{"role": "user", "content": "hi"}]}))
    made[owner].drop_next = 1
    answer = chat(session, gateway.url)  # the conversation "hi", whose replica is `owner`
    assert answer.status_code == 200, answer.text
    assert made[owner].dropped == 1, "the fault was not performed"
    # The same replica answered, on a new connection: the conversation's cache is there.
    assert answer.headers["x-llmgw-replica"] == str(owner)
    assert answer.json()["replica"] == made[owner].name
    other = next(r for pk, r in made.items() if pk != owner)
    assert not other.requests


def test_an_engine_that_closes_every_connection_is_passed_over_for_the_next_replica(gateway, replicas):
    add_model()
    first, second = replicas("first"), replicas("second")
    made = {add_replica("chat", r.base).pk: r for r in (first, second)}
    _, secret = create_key("k")
    session = client(secret)
    until_routed(session, gateway.url)
    ring = prefix.Ring(tuple(Upstream(pk, "", 1) for pk in sorted(made)))
    owner = ring.owner(prefix.key_of({"messages": [{"role": "user", "content": "hi"}]}))
    made[owner].drop_next = 100
    answer = chat(session, gateway.url)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-llmgw-replica"] != str(owner) and made[owner].dropped == 2


def test_a_new_conversation_starts_where_the_fewest_are_in_flight_and_its_later_turns_find_it_through_another_gateway(
    gateway, replicas, tmp_path
):
    """Issue 39: by hash alone a first turn queued on its owner while another replica idled."""
    add_model()
    made = {add_replica("chat", r.base).pk: r for r in (replicas("first"), replicas("second"))}
    _, secret = create_key("k")
    session = client(secret)
    other_gateway, other_url = start_gateway(tmp_path, name="gateway-2")
    try:
        for url in (gateway.url, other_url):
            until_routed(session, url)
        ring = prefix.Ring(tuple(Upstream(pk, "", 1) for pk in sorted(made)))
        busy = ring.owner(prefix.key_of({"messages": opening(0)}))
        idle = next(pk for pk in made if pk != busy)
        held_n, new_n = [n for n in range(1, 100) if ring.owner(prefix.key_of({"messages": opening(n)})) == busy][:2]
        held = session.post(
            gateway.url + "/v1/chat/completions",
            json={"model": "chat", "messages": opening(held_n), "stream": True, "hold": True},
            stream=True,
            timeout=30,
        )
        wait_until(lambda: made[busy].open_streams == 1, timeout=10, what="the held stream at its owner")

        # A new conversation that the ring gives the busy replica starts on the idle one.
        first = chat(session, gateway.url, messages=opening(new_n))
        assert first.status_code == 200, first.text
        assert first.headers["x-llmgw-replica"] == str(idle)
        made[busy].release.set()
        held.close()
        wait_until(lambda: made[busy].open_streams == 0, timeout=10, what="the held stream to end")

        # Its next turn goes where it started, though its owner is idle now; through either gateway.
        later = [*opening(new_n), {"role": "assistant", "content": "ok"}, {"role": "user", "content": "And then?"}]
        assert chat(session, gateway.url, messages=later).headers["x-llmgw-replica"] == str(idle)
        wait_until(
            lambda: chat(session, other_url, messages=later).headers["x-llmgw-replica"] == str(idle),
            timeout=10,
            what="the other gateway process to hear where the conversation started (through Redis)",
        )
        # A conversation that started on its owner stays on the ring's owner, in both.
        assert chat(session, other_url, messages=opening(held_n)).headers["x-llmgw-replica"] == str(busy)
    finally:
        other_gateway.stop()


def test_a_request_another_gateway_counted_at_its_last_write_does_not_move_a_new_conversation_off_its_idle_owner(
    gateway, replicas, redis_client
):
    """CI, session 7: a client's last answer came through another gateway process, whose last write still
    counted it in flight on the owner of the client's next conversation; that one started elsewhere."""
    add_model()
    made = {add_replica("chat", r.base).pk: r for r in (replicas("first"), replicas("second"))}
    _, secret = create_key("k")
    session = client(secret)
    until_routed(session, gateway.url)
    ring = prefix.Ring(tuple(Upstream(pk, "", 1) for pk in sorted(made)))
    owner = ring.owner(prefix.key_of({"messages": opening(0)}))

    # Another gateway process's write, as it was taken while its request to the owner was on its way.
    written_at = time.time()
    phantom = {"at": written_at, "models": {}, "replicas": {str(owner): 1}}
    redis_client.hset(demand.LOAD_KEY, "other-host:1:000000", demand.encode(phantom))

    def read_it() -> bool:
        # The gateway reads every field in the round trip that writes its own: a write after ours has read ours.
        # (its snapshot is taken before it is sent, so one taken after ours was written was sent after it).
        loads = [demand.decode(raw) for raw in redis_client.hgetall(demand.LOAD_KEY).values()]
        return any(load is not None and load["at"] > written_at for load in loads)

    wait_until(read_it, timeout=10, what="the gateway to write its load after ours, reading ours")
    answer = chat(session, gateway.url, messages=opening(0))
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-llmgw-replica"] == str(owner)


def opening(n: int) -> list[dict]:
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Tell me about topic {n}."}]
