"""The ring and the choice of gateway/prefix.py on their own, beside the tests on real replicas (test_prefix.py)."""

from __future__ import annotations

import subprocess
import sys

from gateway import prefix
from gateway.routes import Upstream


def upstreams(*ids: int, weight: int = 1) -> tuple[Upstream, ...]:
    return tuple(Upstream(i, f"http://127.0.0.1:{9000 + i}/v1", weight) for i in ids)


def conversation(n: int, turns: int = 1) -> dict:
    messages = [{"role": "system", "content": f"You are assistant number {n}. " + "Be brief. " * 200}]
    for t in range(turns):
        messages += [{"role": "user", "content": f"Question {t} of conversation {n}?"}]
        messages += [{"role": "assistant", "content": f"Answer {t}."}]
    return {"messages": messages[:-1]}


KEYS = [prefix.key_of(conversation(n)) for n in range(2000)]


def test_every_turn_of_a_conversation_has_the_key_of_its_first():
    first = prefix.key_of(conversation(7, turns=1))
    assert all(prefix.key_of(conversation(7, turns=t)) == first for t in range(2, 9))
    assert prefix.key_of(conversation(8)) != first


def test_the_key_is_bounded_however_long_the_conversation_or_its_system_prompt():
    long = {"messages": [{"role": "system", "content": "x" * 1_000_000}, {"role": "user", "content": "y" * 10**6}]}
    assert len(prefix.key_of(long)) < prefix.KEY_MESSAGES * (prefix.KEY_CHARS + 16)
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "z" * 10**6}, {"type": "image_url"}]}]}
    assert len(prefix.key_of(parts)) <= prefix.KEY_CHARS + 16
    assert prefix.key_of({"messages": []}) is None and prefix.key_of({"prompt": "hi"}) is None


def test_conversations_that_share_a_system_prompt_but_open_differently_have_keys_of_their_own():
    system = {"role": "system", "content": "The same long instructions. " * 100}
    a = {"messages": [system, {"role": "user", "content": "Tell me about cats."}]}
    b = {"messages": [system, {"role": "user", "content": "Tell me about dogs."}]}
    assert prefix.key_of(a) != prefix.key_of(b)


def test_every_gateway_process_builds_the_same_ring_from_the_same_table():
    # Another interpreter, with its own hash seed: the ring depends on the table alone.
    script = (
        "from gateway import prefix; from gateway.routes import Upstream;"
        "ring = prefix.Ring(tuple(Upstream(i, '', 1) for i in (3, 8, 21)));"
        "print([ring.owner(('conversation %d' % n).encode()) for n in range(200)])"
    )
    env = {"DJANGO_SETTINGS_MODULE": "llmgw_site.settings", "PYTHONHASHSEED": "12345", "PATH": "/usr/bin:/bin"}
    other = subprocess.run(
        [sys.executable, "-c", "import django; django.setup(); " + script],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout.strip()
    ring = prefix.Ring(upstreams(21, 3, 8))  # the same replicas in another order
    assert other == str([ring.owner(f"conversation {n}".encode()) for n in range(200)])


def test_keys_spread_over_the_replicas_near_their_fair_share():
    ring = prefix.Ring(upstreams(1, 2, 3, 4))
    owners = [ring.owner(key) for key in KEYS]
    for replica in (1, 2, 3, 4):
        assert 0.18 < owners.count(replica) / len(KEYS) < 0.32, owners.count(replica)


def test_a_replica_that_joins_takes_only_its_share_and_the_rest_stay_where_they_were():
    before = prefix.Ring(upstreams(1, 2, 3))
    after = prefix.Ring(upstreams(1, 2, 3, 4))
    moved = [(before.owner(k), after.owner(k)) for k in KEYS if before.owner(k) != after.owner(k)]
    assert all(new == 4 for _, new in moved), "a key moved between replicas that were there before"
    assert 0.15 < len(moved) / len(KEYS) < 0.35, len(moved)


def test_a_replica_that_leaves_gives_away_only_its_own_keys():
    before = prefix.Ring(upstreams(1, 2, 3, 4))
    after = prefix.Ring(upstreams(1, 2, 4))
    for key in KEYS:
        if before.owner(key) != 3:
            assert after.owner(key) == before.owner(key)


def test_a_standby_of_weight_0_is_on_the_ring_only_when_nothing_else_is():
    ring = prefix.Ring((*upstreams(1, 2), Upstream(3, "", 0)))
    assert {ring.owner(k) for k in KEYS[:200]} == {1, 2}
    assert {prefix.Ring((Upstream(3, "", 0),)).owner(k) for k in KEYS[:20]} == {3}


def choose(ring, key, loads, unusable=(), bound=1.25):
    return prefix.choose(ring, key, lambda r: loads.get(r, 0), lambda r: r in unusable, bound)


def test_the_owner_takes_its_key_until_it_has_more_than_its_bound_then_the_next_on_the_ring_does():
    ring = prefix.Ring(upstreams(1, 2))
    key = KEYS[0]
    owner = ring.owner(key)
    other = 3 - owner
    loads: dict[int, int] = {}
    sent = []
    for _ in range(8):  # eight requests of one hot key, none finished
        upstream, why = choose(ring, key, loads)
        loads[upstream.replica_id] = loads.get(upstream.replica_id, 0) + 1
        sent.append((upstream.replica_id, why))
    assert sent[0] == (owner, prefix.PREFIX) and sent[1] == (owner, prefix.PREFIX)
    assert (other, prefix.BOUNDED) in sent
    # ceil(1.25 × 8 / 2) = 5: the owner never holds more than its bound.
    assert loads[owner] == 5 and loads[other] == 3


def test_a_replica_that_refused_a_moment_ago_is_walked_past_and_said_so():
    ring = prefix.Ring(upstreams(1, 2, 3))
    key = KEYS[1]
    owner = ring.owner(key)
    upstream, why = choose(ring, key, {}, unusable={owner})
    assert upstream.replica_id != owner and why == prefix.UNREACHABLE
    assert choose(ring, key, {}, unusable={1, 2, 3}) is None


def test_a_heavier_replica_owns_more_keys_and_has_a_larger_bound():
    ring = prefix.Ring((Upstream(1, "", 1), Upstream(2, "", 3)))
    owners = [ring.owner(k) for k in KEYS]
    assert 0.65 < owners.count(2) / len(KEYS) < 0.85
    # Loads 3 and 9 of 12: replica 2 may have ceil(1.25 × 13 × 3/4) = 13, replica 1 ceil(1.25 × 13 / 4) = 5.
    key = next(k for k in KEYS if ring.owner(k) == 1)
    assert choose(ring, key, {1: 4, 2: 8})[0].replica_id == 1
    assert choose(ring, key, {1: 5, 2: 8}) == (ring.members[1], prefix.BOUNDED)


def test_a_replica_takes_its_conversations_while_its_slots_have_room_though_the_mean_is_lower():
    # 8 requests on 4 replicas of 4 slots: the mean alone allows ceil(1.25 × 9 / 4) = 3, fewer than the
    # slots, and spilled the owner's next turn to a replica without its cache (issue 39).
    ring = prefix.Ring(tuple(Upstream(i, "", 1, 4) for i in (1, 2, 3, 4)))
    key = KEYS[2]
    owner = ring.owner(key)
    loads = {r: 2 for r in (1, 2, 3, 4)}
    loads[owner] = 3
    loads[next(r for r in (1, 2, 3, 4) if r != owner)] = 1  # 8 in flight in all
    assert choose(ring, key, loads, bound=1.25)[0].replica_id != owner  # the mean alone: spilled
    upstream, why = prefix.choose(ring, key, lambda r: loads[r], lambda r: False, 1.25, 1.25)
    assert (upstream.replica_id, why) == (owner, prefix.PREFIX)
    # ceil(1.25 × 4) = 5 is the slots' bound: the sixth goes on, while the others are idle.
    loads = {r: 0 for r in (1, 2, 3, 4)}
    loads[owner] = 5
    upstream, why = prefix.choose(ring, key, lambda r: loads[r], lambda r: False, 1.25, 1.25)
    assert upstream.replica_id != owner and why == prefix.BOUNDED


def test_once_every_replica_is_busy_the_mean_bound_is_the_larger_and_keeps_the_load_even():
    ring = prefix.Ring(tuple(Upstream(i, "", 1, 2) for i in (1, 2)))
    key = KEYS[3]
    owner = ring.owner(key)
    other = 3 - owner
    # 20 in flight on 2 replicas of 2 slots: the slots allow ceil(1.25 × 2) = 3, the mean ceil(1.25 × 21 / 2) = 14.
    loads = {owner: 13, other: 7}
    upstream, why = prefix.choose(ring, key, lambda r: loads[r], lambda r: False, 1.25, 1.25)
    assert (upstream.replica_id, why) == (owner, prefix.PREFIX)
    loads = {owner: 14, other: 6}
    upstream, why = prefix.choose(ring, key, lambda r: loads[r], lambda r: False, 1.25, 1.25)
    assert (upstream.replica_id, why) == (other, prefix.BOUNDED)


# --- a conversation's first turn, placed by load (issue 39) -------------------------------


def test_a_body_that_is_only_its_conversations_start_is_an_opening_and_a_later_turn_is_not():
    assert prefix.conversation_of(conversation(7, turns=1)).opening
    assert prefix.conversation_of({"messages": [{"role": "user", "content": "hi"}]}).opening
    assert not any(prefix.conversation_of(conversation(7, turns=t)).opening for t in range(2, 5))
    # Two questions before any answer: the key is the first, the body more than it.
    assert not prefix.conversation_of(
        {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}
    ).opening
    # A system prompt alone has no question yet: a key, but not an opening of a conversation.
    assert not prefix.conversation_of({"messages": [{"role": "system", "content": "s"}]}).opening
    assert prefix.conversation_of({"messages": []}) is None


def test_a_new_conversation_starts_where_the_fewest_are_in_flight_and_on_its_owner_when_that_is_one_of_them():
    ring = prefix.Ring(upstreams(1, 2, 3, 4))
    key = KEYS[4]
    owner = ring.owner(key)
    idle = {}
    assert prefix.open_new(ring, key, lambda r: idle.get(r, 0), lambda r: False) == (
        ring.members[owner - 1],
        prefix.PREFIX,
    )
    # The owner busy, the others not: the first of the least busy in the ring's order from the key.
    loads = {r: 1 for r in (1, 2, 3, 4)}
    loads[owner] = 2
    least = next(i for i in (3, 1, 4, 2) if i != owner)
    loads[least] = 0
    upstream, why = prefix.open_new(ring, key, lambda r: loads[r], lambda r: False)
    assert (upstream.replica_id, why) == (least, prefix.NEW)
    # Where the hash alone sent it: its owner, within the bound (the old placement).
    assert choose(ring, key, loads, bound=2)[0].replica_id == owner
    # The owner cooling and the loads even: the ring's next, said as before.
    upstream, why = prefix.open_new(ring, key, lambda r: 0, lambda r: r == owner)
    assert upstream.replica_id != owner and why == prefix.UNREACHABLE
    assert prefix.open_new(ring, key, lambda r: 0, lambda r: True) is None


def test_a_count_another_gateway_wrote_a_moment_ago_alone_does_not_move_a_new_conversation_off_its_owner():
    # CI, session 7: another gateway's last write still counted a request that had ended on the owner,
    # and a client's new conversation started on the other replica, its owner idle.
    ring = prefix.Ring(upstreams(1, 2))
    key = KEYS[0]
    owner = ring.owner(key)
    other = 3 - owner
    everyone = {owner: 1, other: 0}  # this process's none, and another gateway's one on the owner
    mine = {owner: 0, other: 0}
    upstream, why = prefix.open_new(ring, key, everyone.get, lambda r: False, mine.get)
    assert (upstream.replica_id, why) == (owner, prefix.PREFIX)
    # Busier as this process counts its own too: it starts on the other.
    mine[owner] = 1
    upstream, why = prefix.open_new(ring, key, everyone.get, lambda r: False, mine.get)
    assert (upstream.replica_id, why) == (other, prefix.NEW)
    # The owner cooling: the ring's next, whatever the counts.
    upstream, why = prefix.open_new(ring, key, everyone.get, lambda r: r == owner, {owner: 0, other: 0}.get)
    assert (upstream.replica_id, why) == (other, prefix.UNREACHABLE)


def test_sixteen_new_conversations_at_once_fall_four_on_each_of_four_replicas():
    # Issue 39: by hash alone 16 conversations fell 11 / 8 / 4 / 9 on four replicas (bench/prefix.py).
    ring = prefix.Ring(upstreams(1, 2, 3, 4))
    loads = dict.fromkeys((1, 2, 3, 4), 0)
    for key in KEYS[:16]:
        upstream, _ = prefix.open_new(ring, key, lambda r: loads[r], lambda r: False)
        loads[upstream.replica_id] += 1
    assert sorted(loads.values()) == [4, 4, 4, 4]
    by_hash = [ring.owner(key) for key in KEYS[:16]]
    assert max(by_hash.count(r) for r in (1, 2, 3, 4)) > 4, "the keys chosen fall evenly by hash: pick others"


def test_a_later_turn_asks_the_replica_its_conversation_started_on_first_and_the_ring_past_its_bound():
    ring = prefix.Ring(tuple(Upstream(i, "", 1, 4) for i in (1, 2, 3)))
    key = KEYS[5]
    owner = ring.owner(key)
    started = next(r for r in (1, 2, 3) if r != owner)
    loads = dict.fromkeys((1, 2, 3), 0)

    def pick():
        return prefix.choose(ring, key, lambda r: loads[r], lambda r: False, 1.25, 1.25, started_on=started)

    assert (pick()[0].replica_id, pick()[1]) == (started, prefix.PREFIX)
    loads[started] = 5  # ceil(1.25 × 4 slots) = 5: past it, the ring from the key's place, beginning with the owner
    assert (pick()[0].replica_id, pick()[1]) == (owner, prefix.BOUNDED)
    # A replica that is gone (not on the ring) is not asked: the ring's owner takes it.
    gone = prefix.choose(ring, key, lambda r: 0, lambda r: False, 1.25, 1.25, started_on=99)
    assert gone == (ring.members[owner - 1], prefix.PREFIX)


def test_the_table_of_where_conversations_started_keeps_the_most_recent_and_tells_each_placement_once():
    from gateway.conversations import ON_RING, Conversations, decode, encode

    table = Conversations(most=3)
    table.started(10, 2)
    table.started(11, ON_RING)
    table.heard([(12, 4)])
    assert table.started_on(10) == 2  # used: the most recent now
    table.heard([(13, 1)])
    assert (table.started_on(11), table.started_on(10), table.started_on(13)) == (None, 2, 1)
    assert table.take_unsent() == [(10, 2), (11, ON_RING)] and table.take_unsent() == []
    assert decode(encode([(2**63 + 5, 7), (1, 0)])) == [(2**63 + 5, 7), (1, 0)]
    assert decode("zz:1,5:x,ff:3") == [(255, 3)]
