"""A limited key far below its limits goes on without waiting for Redis's answer; near them, it waits (issue 39).

The limiter of a gateway process keeps what Redis last said of each key's counters and
counts what it asked since (gateway/limits/limiter.py `Heard`). While that, with one
more request, stays under LLMGW_LIMITS_FAST_SHARE of every limit, the request goes on
at once and its admission is counted in the same batch as ever; otherwise it waits, as
every limited request did before.
"""

from __future__ import annotations

import asyncio
import signal

from gateway.limits import Limiter, Limits, tag_of, used_now
from gateway.limits.limiter import Ticket

from .support.gateway import clear_of_minute_boundary
from .support.limits import outcomes, run_limiter


def went_on_unanswered(ticket) -> bool:
    """The ticket was handed over while Redis's answer to its admission had not come yet."""
    return isinstance(ticket, Ticket) and bool(ticket.unanswered) and not ticket.unanswered[0].done()


def test_a_key_far_below_its_limits_goes_on_while_redis_has_not_answered_and_is_counted_once_it_does(redis_client):
    from tests import services

    clear_of_minute_boundary(15)
    redis_process = services._state["redis"]
    far, near = Limits(requests_per_minute=100), Limits(requests_per_minute=3)

    async def work(limiter, tag):
        # What Redis says of each key, heard once: 1 of 100, 1 of 3.
        for key_tag, limits in ((tag, far), (tag + "-near", near)):
            limiter.settle(await limiter.admit(key_tag, limits), 0)
        redis_process.send_signal(signal.SIGSTOP)  # no answer comes now (the connection's watchdog waits 2 s)
        try:
            # 1 of 3 and one more is past half of it: this one waits for its answer.
            near_request = asyncio.ensure_future(limiter.admit(tag + "-near", near))
            for _ in range(5):
                await asyncio.sleep(0)  # it has asked, and waits
            fast = await limiter.admit(tag, far)
            fast_went_on, near_waits = went_on_unanswered(fast), not near_request.done()
        finally:
            redis_process.send_signal(signal.SIGCONT)
        limiter.settle(fast, 0)
        limiter.settle(await near_request, 0)
        return fast_went_on, near_waits

    (fast_went_on, near_waits), key_hash = run_limiter(work)
    assert fast_went_on, "the far-below key's request waited for Redis"
    assert near_waits, "the near-limit key's request did not wait for Redis's answer"
    # Counted all the same, once Redis answered: the fast request is in the minute and out of flight.
    used = used_now(redis_client, key_hash)
    assert used["requests_per_minute"] == 2 and used["max_in_flight"] == 0, used


def test_forty_requests_one_after_another_at_ten_a_minute_are_ten_admitted_some_without_waiting(redis_client):
    clear_of_minute_boundary(15)
    limits = Limits(requests_per_minute=10)

    async def work(limiter, tag):
        results, fast = [], []

        async def one():
            ticket = await limiter.admit(tag, limits)
            fast.append(went_on_unanswered(ticket))  # as it is handed over
            return ticket

        for _ in range(10):  # four at a time, ten times: the answers of each four heard before the next
            results += await asyncio.gather(*(one() for _ in range(4)), return_exceptions=True)
        return results, fast.count(True)

    (results, fast), key_hash = run_limiter(work)
    assert outcomes(results).count("admitted") == 10, outcomes(results)
    assert fast >= 1, "no request went on without waiting, though the key was far below its limit"
    assert used_now(redis_client, key_hash)["requests_per_minute"] == 10


def test_a_reservation_taken_as_held_is_replaced_by_the_answers_tokens_exactly(redis_client):
    clear_of_minute_boundary(15)
    limits = Limits(requests_per_minute=1000, tokens_per_minute=100_000)

    async def work(limiter, tag):
        await limiter.admit(tag, limits)  # heard: far below
        tickets = []
        for tokens in (300, 500, 700):
            ticket = await limiter.admitted_and_reserved(limiter.ask(tag, limits), tokens)
            tickets.append((ticket, went_on_unanswered(ticket)))
            limiter.settle(ticket, 7)  # before Redis has answered its reservation: settled once it has
        return tickets

    tickets, key_hash = run_limiter(work)
    assert all(ticket is not None for ticket, _ in tickets)
    assert any(unanswered for _, unanswered in tickets), "every reservation waited for its answer"
    used = used_now(redis_client, key_hash)
    # The warm-up's request settled nothing; each of the three 7 tokens in place of what it reserved.
    assert used["tokens_per_minute"] == 21 and used["max_in_flight"] == 1, used


def test_of_two_processes_on_one_key_one_goes_on_by_what_it_heard_and_once_it_hears_the_key_is_full_it_waits(
    redis_client,
):
    """Two limiters on one key (two gateway processes): what one heard grows stale while the other counts."""
    import secrets

    clear_of_minute_boundary(15)
    limits = Limits(requests_per_minute=8)
    tag = tag_of(secrets.token_hex(32))

    async def go():
        one, other = Limiter(), Limiter()
        try:
            assert await one.admit(tag, limits) is not None  # one hears 1 of 8
            # The other takes 6 more: 7 of 8, which `one` has not heard.
            taken = await asyncio.gather(*(other.admit(tag, limits) for _ in range(6)))
            assert all(t is not None for t in taken)
            # `one` thinks 1 + 1 of 8, within half: it goes on, and Redis counts it (8 of 8).
            stale = await one.admit(tag, limits)
            stale_fast = went_on_unanswered(stale)
            await asyncio.wait([stale.unanswered[0]], timeout=10)
            # Its answer heard (8 of 8), the next waits and is refused: the key is not far below any more.
            later = await asyncio.gather(one.admit(tag, limits), return_exceptions=True)
            return stale_fast, later
        finally:
            await one.close()
            await other.close()

    stale_fast, later = asyncio.run(go())
    assert stale_fast
    assert outcomes(later) == ["refused"], later
