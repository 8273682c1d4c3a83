"""Per-key limits as clients see them: real gateway processes (two, sharing one Redis) in front of a steerable replica."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from django.core.management import call_command

from gateway.keys import create_key
from gateway.limits import used_now
from gateway.models import ApiKey

from .staff_api import token_session
from .support.factories import add_model, add_replica
from .support.gateway import chat, clear_of_minute_boundary, client, error_of, held_stream, until_routed
from .support.gateway_process import start_gateway
from .support.limits import outcomes, run_limiter
from .support.sdk import openai
from .support.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def second_gateway(transactional_db, tmp_path):
    (tmp_path / "second").mkdir()
    process, url = start_gateway(tmp_path / "second")
    yield url
    process.stop()


def test_a_key_at_60_requests_a_minute_sending_100_gets_60_answered_and_40_refused_across_two_gateways(
    gateway, second_gateway, replicas, redis_client
):
    add_model()
    add_replica("chat", replicas().base)
    _, secret = create_key("sixty", limits={"requests_per_minute": 60})
    session = client(secret)
    until_routed(session, gateway.url)
    until_routed(session, second_gateway)
    clear_of_minute_boundary()

    def send(i: int) -> requests.Response:
        url = (gateway.url, second_gateway)[i % 2]
        return requests.post(
            url + "/v1/chat/completions",
            json={"model": "chat", "messages": [{"role": "user", "content": "hi"}]},
            headers={"Authorization": f"Bearer {secret}"},
            timeout=30,
        )

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(send, range(100)))
    statuses = [a.status_code for a in answers]
    assert statuses.count(200) == 60 and statuses.count(429) == 40, statuses
    # Both processes answered some and refused some: the count is shared, not each one's own.
    for i in (0, 1):
        assert {a.status_code for a in answers[i::2]} == {200, 429}

    refused = next(a for a in answers if a.status_code == 429)
    error = error_of(refused)
    assert error["message"].startswith("This API key is over its limit of 60 requests per minute")
    assert error["code"] == "rate_limit_exceeded"
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    assert refused.headers["x-ratelimit-limit-requests"] == "60"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert refused.headers["x-ratelimit-reset-requests"].endswith("s")

    # The official client raises its rate-limit error, with the sentence.
    api = openai.OpenAI(base_url=gateway.url + "/v1", api_key=secret, max_retries=0)
    with pytest.raises(openai.RateLimitError) as raised:
        api.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}])
    assert "60 requests per minute" in str(raised.value)
    assert raised.value.response.headers["x-ratelimit-limit-requests"] == "60"


def test_a_key_with_two_requests_in_flight_is_refused_a_third_until_one_ends(gateway, replicas, redis_client):
    add_model()
    replica = replicas()
    add_replica("chat", replica.base)
    _, secret = create_key("two-at-once", limits={"max_in_flight": 2})
    until_routed(client(secret), gateway.url)
    first, second = held_stream(gateway.url, secret), held_stream(gateway.url, secret)
    assert first.status_code == second.status_code == 200
    third = chat(client(secret), gateway.url)
    assert third.status_code == 429
    assert error_of(third)["message"] == "This API key may have 2 requests in flight at once, and has 2."
    assert third.headers["retry-after"] == "1"
    replica.release.set()
    for held in (first, second):
        assert held.content.endswith(b"data: [DONE]\n\n")
    # The flights end when the answers do (written just after the client has them).
    wait_until(lambda: chat(client(secret), gateway.url).status_code == 200, timeout=5, what="a request to go again")


def test_a_key_over_its_tokens_per_minute_is_refused_once_the_answers_usage_is_counted(gateway, replicas, redis_client):
    add_model()
    replica = replicas()
    replica.usage = {"prompt_tokens": 11, "completion_tokens": 3}  # 14 tokens an answer
    add_replica("chat", replica.base)
    body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    # What a request reserves while it runs: its prompt by its body's size (4 bytes a token), and its max_tokens.
    reserved = -(-len(json.dumps(body)) // 4) + 3
    key, secret = create_key("tight", limits={"tokens_per_minute": 14 + reserved})
    session = client(secret)
    until_routed(session, gateway.url)
    clear_of_minute_boundary(10)
    assert chat(session, gateway.url, max_tokens=3).status_code == 200
    wait_until(lambda: used_now(redis_client, key.key_hash)["tokens_per_minute"] == 14, timeout=5, what="14 tokens")
    # 14 used: this one's reservation fits, and its 14 take the minute to 28.
    assert chat(session, gateway.url, max_tokens=3).status_code == 200
    wait_until(lambda: used_now(redis_client, key.key_hash)["tokens_per_minute"] == 28, timeout=5, what="28 tokens")
    refused = chat(session, gateway.url, max_tokens=3)
    assert refused.status_code == 429
    assert error_of(refused)["message"].startswith(
        f"This API key is over its limit of {14 + reserved} tokens per minute: 28 tokens used or reserved in this "
        f"window, and this request may use {reserved} (its prompt by its size, and its max_tokens)"
    )
    assert refused.headers["x-ratelimit-limit-tokens"] == str(14 + reserved)
    assert refused.headers["x-ratelimit-remaining-tokens"] == str(reserved - 14)
    assert "x-ratelimit-limit-requests" not in refused.headers
    # The refused request's flight ended with it, and it reserved nothing.
    wait_until(lambda: used_now(redis_client, key.key_hash)["max_in_flight"] == 0, timeout=5, what="no flight")
    used = used_now(redis_client, key.key_hash)
    assert used["tokens_per_day"] == used["tokens_per_month"] == 28 and used["requests_per_minute"] == 3


def test_a_key_without_limits_costs_redis_nothing(gateway, replicas, redis_client):
    add_model()
    add_replica("chat", replicas().base)
    _, secret = create_key("free")
    until_routed(client(secret), gateway.url)
    for _ in range(5):
        assert chat(client(secret), gateway.url).status_code == 200
    assert list(redis_client.scan_iter("llmgw:limit:*")) == []


def test_limits_are_set_with_manage_py_api_key_and_the_api(capsys):
    call_command("api_key", "create", "scripted", "--rpm", "60", "--tpd", "100000")
    key = ApiKey.objects.get(name="scripted")
    assert (key.requests_per_minute, key.tokens_per_day, key.tokens_per_minute) == (60, 100000, None)
    call_command("api_key", "update", "scripted", "--rpm", "0", "--in-flight", "4")
    key.refresh_from_db()
    assert (key.requests_per_minute, key.max_in_flight) == (None, 4)
    assert "4 requests in flight at once" in capsys.readouterr().out


def test_limits_are_set_and_read_through_the_api(live_server):
    api = token_session()
    made = api.post(live_server.url + "/api/gateway/keys/", json={"name": "auto", "tokens_per_minute": 5000})
    assert made.status_code == 201, made.text
    assert made.json()["tokens_per_minute"] == 5000 and made.json()["requests_per_minute"] is None
    changed = api.patch(live_server.url + f"/api/gateway/keys/{made.json()['id']}/", json={"requests_per_minute": 30})
    assert changed.status_code == 200, changed.text
    assert ApiKey.objects.get(name="auto").limits() == (30, 5000, 0, 0, 0)


def test_a_limit_set_on_a_running_key_is_enforced_within_a_second(gateway, replicas, redis_client):
    add_model()
    add_replica("chat", replicas().base)
    key, secret = create_key("tightened")
    session = client(secret)
    until_routed(session, gateway.url)
    clear_of_minute_boundary(10)
    assert chat(session, gateway.url).status_code == 200
    # A queryset update sends no signal: the change log's trigger is what the gateway hears.
    ApiKey.objects.filter(pk=key.pk).update(requests_per_minute=2)
    wait_until(lambda: chat(session, gateway.url).status_code == 429, timeout=5, what="the new limit to refuse")


def test_the_keys_admin_page_shows_what_it_used_against_its_limits(admin_client, redis_client):
    from gateway.limits import Windows, tag_of

    key, _ = create_key("watched", limits={"requests_per_minute": 60, "tokens_per_day": 1000})
    windows = Windows.at(tag_of(key.key_hash), time.time())
    redis_client.set(windows.keys[0], 7)
    redis_client.set(windows.keys[2], 420)
    page = admin_client.get(f"/admin/gateway/apikey/{key.pk}/change/").content.decode()
    assert "requests per minute: 7 of 60" in page
    assert "tokens per day: 420 of 1000" in page
    assert "tokens per minute: 0 (no limit)" in page


def test_with_redis_away_a_limited_key_goes_on_unchecked_and_the_log_says_so(caplog):
    import asyncio

    from gateway.limits import Limiter, Limits
    from tests.services import free_port

    async def ask():
        limiter = Limiter(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
        started = time.monotonic()
        ticket = await limiter.admit("abc", Limits(requests_per_minute=1))
        await limiter.close()
        return ticket, time.monotonic() - started

    ticket, took = asyncio.run(ask())
    assert ticket is None and took < 1
    assert "per-key limits are not enforced while Redis cannot be reached" in caplog.text


def test_a_hundred_requests_of_one_turn_of_the_loop_at_60_a_minute_are_60_admitted_and_40_refused(redis_client):
    import asyncio

    from gateway.limits import Limits

    clear_of_minute_boundary(10)
    limits = Limits(requests_per_minute=60)

    async def work(limiter, tag):
        # All asked before any reply: they go to Redis in one batch, and the batch admits exactly 60.
        return await asyncio.gather(*(limiter.admit(tag, limits) for _ in range(100)), return_exceptions=True)

    results, key_hash = run_limiter(work)
    assert outcomes(results) == ["admitted"] * 60 + ["refused"] * 40
    assert results[60].message.startswith("This API key is over its limit of 60 requests per minute: 60 requests")
    assert used_now(redis_client, key_hash)["requests_per_minute"] == 60


def test_a_batch_larger_than_one_script_takes_is_counted_whole(redis_client):
    import asyncio

    from gateway.limits import BATCH, Limits

    clear_of_minute_boundary(10)
    limits = Limits(requests_per_minute=BATCH * 2)

    async def work(limiter, tag):
        return await asyncio.gather(
            *(limiter.admit(tag, limits) for _ in range(BATCH * 2 + 50)), return_exceptions=True
        )

    results, key_hash = run_limiter(work)
    assert outcomes(results) == ["admitted"] * (BATCH * 2) + ["refused"] * 50
    assert used_now(redis_client, key_hash)["requests_per_minute"] == BATCH * 2


def test_flights_ended_in_a_turn_of_the_loop_make_room_for_the_requests_of_that_turn(redis_client):
    import asyncio

    from gateway.limits import Limits

    clear_of_minute_boundary(10)
    limits = Limits(max_in_flight=3)

    async def work(limiter, tag):
        first = await asyncio.gather(*(limiter.admit(tag, limits) for _ in range(5)), return_exceptions=True)
        # Two answers end, and in the same turn four more requests come: two of them fit.
        for ticket in first[:2]:
            limiter.settle(ticket, 7)
        second = await asyncio.gather(*(limiter.admit(tag, limits) for _ in range(4)), return_exceptions=True)
        return first, second

    (first, second), key_hash = run_limiter(work)
    assert outcomes(first) == ["admitted"] * 3 + ["refused"] * 2
    assert outcomes(second) == ["admitted"] * 2 + ["refused"] * 2
    assert second[2].message == "This API key may have 3 requests in flight at once, and has 3."
    used = used_now(redis_client, key_hash)
    assert used["max_in_flight"] == 3
    assert used["tokens_per_minute"] == used["tokens_per_day"] == used["tokens_per_month"] == 14


def test_a_redis_that_forgot_the_scripts_is_sent_them_again(redis_client):
    from gateway.limits import Limits

    limits = Limits(requests_per_minute=1000)

    async def work(limiter, tag):
        before = await limiter.admit(tag, limits)
        redis_client.script_flush()  # an operator's SCRIPT FLUSH, under the gateway's open connection
        after = await limiter.admit(tag, limits)
        limiter.settle(after, 5)
        return before, after

    (before, after), key_hash = run_limiter(work)
    assert before is not None and after is not None
    used = used_now(redis_client, key_hash)
    assert used["requests_per_minute"] == 2 and used["tokens_per_minute"] == 5 and used["max_in_flight"] == 1


def test_a_redis_that_stops_answering_lets_limited_requests_go_on_unchecked_and_is_used_again_when_it_answers(
    redis_client, monkeypatch, caplog
):
    import signal

    from gateway.limits import Limits
    from gateway.limits import connection as limits_module
    from tests import services

    monkeypatch.setattr(limits_module, "TIMEOUT_S", 0.3)
    redis_process = services._state["redis"]
    limits = Limits(requests_per_minute=1000)

    async def work(limiter, tag):
        assert await limiter.admit(tag, limits) is not None
        redis_process.send_signal(signal.SIGSTOP)  # Redis frozen: the connection stays open, nothing answers
        try:
            started = time.monotonic()
            # A key this process has heard nothing of waits for its answer (one far below its limits would
            # not: test_limits_fast_admission.py).
            silent = await limiter.admit(tag + "-other", limits)
            took = time.monotonic() - started
        finally:
            redis_process.send_signal(signal.SIGCONT)
        again = await limiter.admit(tag, limits)
        return silent, took, again

    (silent, took, again), _ = run_limiter(work)
    # Silent for TIMEOUT_S (at most twice that): the request goes on unchecked, and the log says so.
    assert silent is None and took < 2 * 0.3 + 0.3, took
    assert "per-key limits are not enforced while Redis cannot be reached" in caplog.text
    assert again is not None  # a new connection, once Redis answers again


def test_a_small_request_with_token_limits_is_admitted_and_reserved_in_one_round_trip_and_a_refused_one_holds_nothing(
    redis_client,
):
    import asyncio

    from gateway.limits import Limits

    clear_of_minute_boundary(10)
    limits = Limits(requests_per_minute=3, tokens_per_minute=10_000)

    async def work(limiter, tag):
        await limiter.admit(tag, Limits(requests_per_minute=1000))  # connected, so what follows is one batch each
        batches = []
        send = limiter._send
        limiter._send = lambda: (batches.append(1), send())
        # Four requests of one turn, each reservation queued before its admission has answered.
        both = [limiter.admitted_and_reserved(limiter.ask(tag, limits), 100) for _ in range(4)]
        results = await asyncio.gather(*both, return_exceptions=True)
        return results, len(batches)

    (results, batches), key_hash = run_limiter(work)
    assert batches == 1, f"admission and reservation took {batches} round trips to Redis"
    assert outcomes(results) == ["admitted"] * 2 + ["refused"] * 2  # the warm-up took one of the minute's 3
    assert results[2].message.startswith("This API key is over its limit of 3 requests per minute")
    # The two refused by ADMIT had their RESERVE in the same batch: it held nothing for them.
    used = used_now(redis_client, key_hash)
    assert used["tokens_per_minute"] == 200 and used["requests_per_minute"] == 3 and used["max_in_flight"] == 3
