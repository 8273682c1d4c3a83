"""Teams' budgets in the gateway: shared by a team's keys across gateway processes, counted in the same Redis
script as a key's own limits; keys refused when expired or when their owner left the team; spend at the prices."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from zoneinfo import ZoneInfo

import pytest
import requests
from django.contrib.auth import get_user_model
from django.db import transaction
from django.utils import timezone

from accounts.models import Team, TeamMember
from catalog.models import Model
from gateway.keys import create_key
from gateway.limits import Windows, calendar, tag_of
from gateway.models import ApiKey, Usage

from .support.factories import add_model, add_replica
from .support.gateway import chat, client, error_of, until_routed
from .support.gateway_process import start_gateway
from .support.waiting import wait_until


def team_key(name: str, team: Team, owner=None, **fields) -> tuple[ApiKey, str]:
    # One transaction: a gateway reading its table between the two would know the key a moment without its team.
    with transaction.atomic():
        key, secret = create_key(name)
        ApiKey.objects.filter(pk=key.pk).update(team=team, owner=owner, **fields)
    key.refresh_from_db()
    return key, secret


def test_a_month_and_a_day_are_counted_in_the_budgets_time_zone_not_utc():
    paris = ZoneInfo("Europe/Paris")
    # 23:30 UTC on 31 January is 00:30 on 1 February in Paris: February's budget, and its day.
    now = datetime(2027, 1, 31, 23, 30, tzinfo=UTC).timestamp()
    day, month, day_end, month_end = calendar(now, paris)
    assert (day, month) == ("20270201", "202702")
    assert day_end == datetime(2027, 2, 1, 23, 0, tzinfo=UTC).timestamp()  # midnight in Paris (UTC+1)
    assert month_end == datetime(2027, 2, 28, 23, 0, tzinfo=UTC).timestamp()
    # The same moment in UTC is still January.
    assert calendar(now, ZoneInfo("UTC"))[:2] == ("20270131", "202701")
    # March's month ends at midnight Paris summer time (UTC+2): 31 March 22:00 UTC; the day the clocks
    # go forward (28 March 2027) is 23 hours long.
    march = datetime(2027, 3, 28, 12, 0, tzinfo=paris).timestamp()
    _, _, day_end, month_end = calendar(march, paris)
    assert month_end == datetime(2027, 3, 31, 22, 0, tzinfo=UTC).timestamp()
    assert day_end - datetime(2027, 3, 28, 0, 0, tzinfo=paris).timestamp() == 23 * 3600
    # December rolls over into January of the next year.
    assert (
        calendar(datetime(2027, 12, 15, tzinfo=paris).timestamp(), paris)[3]
        == datetime(2028, 1, 1, tzinfo=paris).timestamp()
    )


@pytest.mark.django_db(transaction=True)
def test_two_keys_of_a_team_through_two_gateways_stop_together_when_the_teams_tokens_per_day_are_spent(
    gateway, tmp_path, replicas, redis_client
):
    (tmp_path / "second").mkdir()
    second, second_url = start_gateway(tmp_path / "second")
    try:
        model = add_model()
        Model.objects.filter(pk=model.pk).update(
            price_input=Decimal("2.5"), price_cached_input=Decimal("1"), price_output=Decimal("10")
        )
        replica = replicas()
        replica.usage = {"prompt_tokens": 11, "completion_tokens": 3}  # 14 tokens an answer
        add_replica("chat", replica.base)
        body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        reserved = -(-len(json.dumps(body)) // 4) + 3  # what one request holds while it runs
        budget = 300
        team = Team.objects.create(name="research", tokens_per_day=budget)
        one, first_secret = team_key("research-one", team)
        two, second_secret = team_key("research-two", team)
        for secret in (first_secret, second_secret):
            for url in (gateway.url, second_url):
                until_routed(client(secret), url)

        def send(i: int) -> requests.Response:
            secret = (first_secret, second_secret)[i % 2]
            url = (gateway.url, second_url)[(i // 2) % 2]
            return requests.post(
                url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {secret}"}, timeout=30
            )

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(send, range(40)))
        statuses = [a.status_code for a in answers]
        assert set(statuses) == {200, 429}, statuses
        # Each key, through each process, met the team's budget: the count is the team's, not a key's or a process's.
        for i in range(4):
            assert 429 in [a.status_code for a in answers[i::4]]
        answered = statuses.count(200)
        # Within one answer of the budget, and never past it.
        assert budget - reserved < answered * 14 <= budget
        team_day = Windows.at(tag_of(one.key_hash), datetime.now().timestamp(), f"team{team.pk}").keys[7]
        wait_until(lambda: int(redis_client.get(team_day) or 0) == answered * 14, timeout=5, what="the team's day")

        refused = next(a for a in answers if a.status_code == 429)
        error = error_of(refused)
        # What was used or held by requests still running when it came: within one request of the budget.
        said = re.fullmatch(
            rf"The team research is over its budget of {budget} tokens per day: (\d+) tokens used or reserved, "
            rf"and this request may use {reserved} \(its prompt by its size, and its max_tokens\); "
            r"it resets in \S+ \(at \d{4}-\d\d-\d\d 00:00 UTC\)\.",
            error["message"],
        )
        assert said, error["message"]
        assert budget - reserved < int(said.group(1)) <= budget
        assert "it resets in" in error["message"] and error["code"] == "rate_limit_exceeded"
        assert 1 <= int(refused.headers["retry-after"]) <= 86400

        # Both keys stay refused, in both processes, once the answers are counted.
        for secret in (first_secret, second_secret):
            for url in (gateway.url, second_url):
                assert chat(client(secret), url, max_tokens=3).status_code == 429

        # Usage: the engine's tokens at the model's prices (11 × 2.5 + 3 × 10 per million an answer).
        def written():
            rows = Usage.objects.filter(key__in=[one, two])
            return sum(r.requests for r in rows) == answered and rows

        rows = wait_until(written, timeout=10, what="the usage to be written")
        assert sum(r.prompt_tokens for r in rows) == 11 * answered
        assert sum(r.spend for r in rows) == (11 * Decimal("2.5") + 3 * Decimal("10")) * answered / 1_000_000
    finally:
        second.stop()


@pytest.mark.django_db(transaction=True)
def test_an_expired_key_a_key_whose_owner_left_the_team_and_a_model_outside_the_teams_list_are_refused(
    gateway, replicas, redis_client
):
    add_model()
    add_model("other")
    add_replica("chat", replicas().base)
    add_replica("other", replicas().base)
    person = get_user_model().objects.create_user("ada")
    team = Team.objects.create(name="lab", model_names=["chat"], requests_per_minute=1000)
    membership = TeamMember.objects.create(team=team, user=person)
    _, expired = team_key("lab-expired", team, person, expires=timezone.now() - timedelta(minutes=1))
    _, mine = team_key("lab-ada", team, person)
    _, own_list = team_key("lab-other", team, model_names=["other"])
    session = client(mine)
    until_routed(session, gateway.url)

    answer = chat(client(expired), gateway.url)
    assert answer.status_code == 401
    assert error_of(answer)["message"].startswith("This API key expired at ")

    # The team's list allows "chat" only: "other" is refused, and a key naming only "other" may use nothing.
    assert chat(session, gateway.url).status_code == 200
    outside = chat(session, gateway.url, model="other")
    assert outside.status_code == 403
    assert error_of(outside)["message"] == "This API key may not use the model other."
    assert chat(client(own_list), gateway.url, model="other").status_code == 403

    # The team's list grows: its keys may use the new model as soon as the gateway hears.
    Team.objects.filter(pk=team.pk).update(model_names=["chat", "other"])
    wait_until(
        lambda: chat(session, gateway.url, model="other").status_code == 200, timeout=10, what="the team's new model"
    )

    # The owner leaves the team: their key is refused as soon as the gateway hears.
    membership.delete()
    wait_until(lambda: chat(session, gateway.url).status_code == 403, timeout=10, what="the key to be refused")
    left = error_of(chat(session, gateway.url))
    assert left["message"] == "This API key's owner is no longer a member of the team lab, whose key it is."
    # Back in the team, the key works again; turned off, its owner loses it again.
    TeamMember.objects.create(team=team, user=person)
    wait_until(lambda: chat(session, gateway.url).status_code == 200, timeout=10, what="the key to work again")
    get_user_model().objects.filter(pk=person.pk).update(is_active=False)
    wait_until(lambda: chat(session, gateway.url).status_code == 403, timeout=10, what="the owner's key refused")


def test_cached_input_is_priced_at_its_own_price_or_else_at_the_input_price():
    from gateway.routes import prices_of
    from gateway.usage import cost, micro_units

    prices = prices_of(Decimal("2"), Decimal("0.5"), Decimal("8"))
    # 100 prompt tokens of which 40 cached, 10 out: 60 × 2 + 40 × 0.5 + 10 × 8 micro-units.
    assert cost(prices, 100, 10, 40) == Decimal(220)
    assert cost(prices_of(Decimal("2"), None, Decimal("8")), 100, 10, 40) == Decimal(280)
    assert cost(prices_of(None, None, None), 100, 10, 40) == 0
    assert micro_units(Decimal("0.25")) == 1  # a budget never loses a fraction it does not see


@pytest.mark.engine
@pytest.mark.django_db(transaction=True)
def test_a_teams_spend_budget_stops_its_key_and_usage_spend_is_the_engines_tokens_at_the_prices(
    tmp_path, tiny_gguf, gateway, redis_client
):
    from agent import engines
    from catalog.models import Profile
    from fleet.models import Node, Replica

    from . import real_model

    process, endpoint, _ = real_model.start_engine(tiny_gguf, tmp_path, ["--parallel", "1"])
    try:
        model = Model.objects.create(
            name=real_model.MODEL,
            source="http://127.0.0.1:1/tiny/",
            context_length=256,
            price_input=Decimal("1000"),
            price_output=Decimal("4000"),
        )
        Profile.objects.create(model=model, name="cpu", engine="llamacpp")
        node = Node.objects.create(name="n1")
        Replica.objects.create(
            model_name=real_model.MODEL, profile_name="cpu", node=node, state="ready", endpoint=endpoint
        )
        budget = Decimal("0.25")
        team = Team.objects.create(name="finance", spend_per_month=budget)
        key, secret = team_key("finance-one", team)
        session = client(secret)
        until_routed(session, gateway.url, real_model.MODEL)
        counted = []  # (prompt, completion) as the engine counted each answer
        refused = None
        for i in range(40):
            body = {"model": real_model.MODEL, "messages": [{"role": "user", "content": f"Say {i}"}], "max_tokens": 4}
            answer = session.post(gateway.url + "/v1/chat/completions", json=body, timeout=120)
            if answer.status_code == 429:
                refused = answer
                break
            assert answer.status_code == 200, answer.text
            usage = answer.json()["usage"]
            counted.append((usage["prompt_tokens"], usage["completion_tokens"]))
        assert refused is not None and len(counted) >= 2, counted
        message = error_of(refused)["message"]
        assert message.startswith(f"The team finance is over its monthly spend budget of {budget.normalize()}: ")
        assert "this month" in message and "it resets in" in message
        expected = sum(p * Decimal(1000) + c * Decimal(4000) for p, c in counted) / 1_000_000
        assert expected <= budget

        def written():
            rows = list(Usage.objects.filter(key=key))
            return sum(r.requests for r in rows) == len(counted) and rows

        rows = wait_until(written, timeout=10, what="the usage to be written")
        assert sum(r.spend for r in rows) == expected
        assert sum(r.prompt_tokens for r in rows) == sum(p for p, _ in counted)
    finally:
        engines.stop_group(process.pid, grace=5)
        process.wait(timeout=10)


@pytest.mark.django_db(transaction=True)
def test_the_catalog_api_shows_and_sets_a_models_prices_and_refuses_a_negative_one_with_a_sentence(api):
    from .support.factories import new_model

    made = api.post(api.base + "/api/catalog/models/", json=new_model())
    assert made.status_code == 201, made.text
    shown = made.json()
    assert (shown["price_input"], shown["price_cached_input"], shown["price_output"]) == (None, None, None)
    changed = api.patch(
        api.base + f"/api/catalog/models/{shown['id']}/", json={"price_input": "2.5", "price_output": "10"}
    )
    assert changed.status_code == 200, changed.text
    assert Model.objects.get(pk=shown["id"]).price_input == Decimal("2.5")
    assert (changed.json()["price_input"], changed.json()["price_output"]) == ("2.500000", "10.000000")
    refused = api.patch(api.base + f"/api/catalog/models/{shown['id']}/", json={"price_output": "-1"})
    assert refused.status_code == 400
    assert refused.json()["price_output"] == ["Ensure this value is greater than or equal to 0."]


def test_a_clients_next_request_is_judged_with_its_last_answer_counted_though_redis_answered_after_the_engine(
    gateway, replicas, redis_client
):
    """CI, session 7: a request let through without waiting for Redis (far below its budget) had its answer
    before Redis had answered; its cost was sent only after those answers, behind the client's next request,
    which Redis judged without it. Here Redis is paused while the second answer comes back."""
    add_model()
    # 1,000 micro-units a prompt token: an answer of 100 prompt tokens costs 0.1, and reserves ~0.03 (its size).
    Model.objects.filter(name="chat").update(price_input=Decimal("1000"), price_output=Decimal("0"))
    replica = replicas()
    replica.usage = {"prompt_tokens": 100, "completion_tokens": 1}
    add_replica("chat", replica.base)
    team = Team.objects.create(name="finance", spend_per_month=Decimal("0.15"))
    _, secret = team_key("finance-one", team)
    session = client(secret)
    until_routed(session, gateway.url)

    assert chat(session, gateway.url).status_code == 200  # 0.1 spent: under the budget of 0.15
    # The next is far enough below it, as the gateway last heard (the first's reservation), to go on at once.
    redis_client.execute_command("CLIENT", "PAUSE", 1500, "ALL")
    second = chat(session, gateway.url)
    assert second.status_code == 200, second.text  # 0.2 spent: over the budget
    third = chat(session, gateway.url)
    assert third.status_code == 429, f"the third request was let through: {third.status_code}"
    assert error_of(third)["message"].startswith("The team finance is over its monthly spend budget of 0.15: ")
    assert len(replica.requests) == 2


def test_a_clients_next_request_through_another_gateway_process_is_judged_with_its_last_answer_counted(
    gateway, replicas, tmp_path
):
    """An answer's settling went within 2 ms of its last byte, in the next batch; a client whose next request went
    to another gateway process (another worker, another host) could be judged before it, and got past its budget."""
    add_model()
    # 1,000 micro-units a prompt token: an answer of 100 prompt tokens costs 0.1, and reserves ~0.03 (its size).
    Model.objects.filter(name="chat").update(price_input=Decimal("1000"), price_output=Decimal("0"))
    replica = replicas()
    replica.usage = {"prompt_tokens": 100, "completion_tokens": 1}
    add_replica("chat", replica.base)
    other, other_url = start_gateway(tmp_path, name="gateway-2")
    try:
        for turn in range(5):
            team = Team.objects.create(name=f"finance-{turn}", spend_per_month=Decimal("0.2"))
            _, secret = team_key(f"finance-{turn}", team)
            first, second = client(secret), client(secret)
            until_routed(first, gateway.url)
            until_routed(second, other_url)
            assert chat(first, gateway.url).status_code == 200  # 0.1 spent
            assert chat(first, gateway.url).status_code == 200  # 0.2: the budget, spent
            third = chat(second, other_url)
            assert third.status_code == 429, f"turn {turn}: the third request was let through: {third.status_code}"
            assert error_of(third)["message"].startswith(f"The team finance-{turn} is over its monthly spend budget")
    finally:
        other.stop()
