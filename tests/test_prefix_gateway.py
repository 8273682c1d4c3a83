"""Prefix routing in the gateway process against fake replicas: the faults an engine cannot be made to show on cue."""

from __future__ import annotations

import pytest

from gateway import prefix
from gateway.keys import create_key
from gateway.routes import Upstream

from .support.factories import add_model, add_replica
from .support.gateway import chat, client, until_routed

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
