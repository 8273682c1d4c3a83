"""The people API (/api/people/): teams, members, keys and usage, each row seen only by whom it concerns.

Attacked as someone would: ids of another team's keys, members and teams guessed in URLs and
posted in bodies, answered as if they were not there.
"""

import asyncio
import csv
import io
import socket
from datetime import date, timedelta

import pytest
from django.contrib.auth.models import Permission
from django.test import Client
from rest_framework.test import APIClient

from accounts.models import TeamMember
from gateway.keys import hash_key
from gateway.limits import BUDGET_FIELDS, Limiter, budget_of, tag_of
from gateway.models import ApiKey
from people.budgets import today

from .support.gateway import clear_of_minute_boundary
from .support.people import key_of, person, two_teams, used

pytestmark = pytest.mark.django_db

API = "/api/people"
TODAY = date(2026, 12, 4)


@pytest.fixture
def org():
    return two_teams()


def as_user(user) -> APIClient:
    client = APIClient()
    client.force_login(user)
    return client


def names(response) -> set[str]:
    assert response.status_code == 200, response.content
    return {row["name"] for row in response.json()["results"]}


def test_nobody_signed_out_reads_anything():
    for path in ("teams/", "members/", "keys/", "usage/", "usage.csv"):
        assert APIClient().get(f"{API}/{path}").status_code in (401, 403)


def test_a_person_lists_only_their_own_keys_and_another_persons_key_id_is_not_found(org):
    alice = as_user(org.alice)
    assert names(alice.get(f"{API}/keys/")) == {"alice-laptop"}
    for other in (org.arthur_key, org.bob_key):
        answer = alice.get(f"{API}/keys/{other.pk}/")
        assert answer.status_code == 404
        assert other.name not in answer.content.decode()
    # A guessed id answers as a missing one does: nothing tells them apart.
    assert alice.get(f"{API}/keys/999999/").status_code == 404


def test_a_team_admin_sees_the_teams_keys_but_not_another_teams(org):
    arthur = as_user(org.arthur)
    assert names(arthur.get(f"{API}/keys/")) == {"alice-laptop", "arthur-notebook"}
    assert arthur.get(f"{API}/keys/{org.bob_key.pk}/").status_code == 404
    assert names(arthur.get(f"{API}/keys/", {"team": org.blue.pk})) == set()


def test_staff_with_the_keys_view_permission_see_every_key_and_staff_without_it_only_their_own(org):
    viewer = person("vera", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_apikey"))
    assert names(as_user(viewer).get(f"{API}/keys/")) == {"alice-laptop", "arthur-notebook", "bob-secret-project"}
    bare = person("steve", is_staff=True)
    assert names(as_user(bare).get(f"{API}/keys/")) == set()


def test_a_key_made_through_the_api_is_answered_once_and_is_its_makers_for_their_team(org):
    answer = as_user(org.alice).post(
        f"{API}/keys/", {"name": "alice-ci", "team": org.red.pk, "models": ["chat"]}, format="json"
    )
    assert answer.status_code == 201, answer.content
    secret = answer.json()["key"]
    key = ApiKey.objects.get(name="alice-ci")
    assert (key.owner, key.team, key.model_names, key.key_hash) == (org.alice, org.red, ["chat"], hash_key(secret))
    again = as_user(org.alice).get(f"{API}/keys/{key.pk}/")
    assert again.status_code == 200 and secret not in again.content.decode() and "key" not in again.json()


def test_posting_another_teams_id_or_a_made_up_one_when_making_a_key_makes_nothing(org):
    before = ApiKey.objects.count()
    answers = [
        as_user(org.alice).post(f"{API}/keys/", {"name": "sneaky", "team": team}, format="json")
        for team in (org.blue.pk, 999999, -1)
    ]
    assert [a.status_code for a in answers] == [400, 400, 400]
    # Another team's id and one that does not exist are refused in the same words.
    assert len({a.content for a in answers}) == 1
    assert "one of your own teams" in answers[0].json()["detail"]
    assert ApiKey.objects.count() == before


def test_a_key_may_not_name_a_model_outside_its_teams_or_expire_in_the_past(org):
    alice = as_user(org.alice)
    wider = alice.post(f"{API}/keys/", {"name": "wide", "team": org.red.pk, "models": ["secret"]}, format="json")
    assert wider.status_code == 400 and "may not use secret" in wider.json()["detail"]
    past = alice.post(
        f"{API}/keys/", {"name": "old", "team": org.red.pk, "expires": "2001-01-01T00:00:00Z"}, format="json"
    )
    assert past.status_code == 400 and "future" in past.json()["detail"]
    assert not ApiKey.objects.filter(name__in=["wide", "old"]).exists()


def test_revoking_another_persons_key_id_is_not_found_and_the_key_stays_on(org):
    for attacker, victim in ((org.alice, org.bob_key), (org.alice, org.arthur_key), (org.arthur, org.bob_key)):
        assert as_user(attacker).post(f"{API}/keys/{victim.pk}/revoke/").status_code == 404
        victim.refresh_from_db()
        assert victim.active
    # The same request on one's own key does it: the 404s above are the guard, not a missing route.
    assert as_user(org.bob).post(f"{API}/keys/{org.bob_key.pk}/revoke/").status_code == 200


def test_a_person_revokes_their_own_key_and_a_team_admin_a_team_members(org):
    assert as_user(org.alice).post(f"{API}/keys/{org.alice_key.pk}/revoke/").json()["active"] is False
    assert as_user(org.arthur).post(f"{API}/keys/{org.arthur_key.pk}/revoke/").status_code == 200
    extra = key_of(org.alice, org.red, "alice-extra")
    assert as_user(org.arthur).post(f"{API}/keys/{extra.pk}/revoke/").status_code == 200
    extra.refresh_from_db()
    assert not extra.active


def test_teams_and_members_of_another_team_are_not_listed_nor_found_by_id(org):
    alice = as_user(org.alice)
    assert names(alice.get(f"{API}/teams/")) == {"red"}
    assert alice.get(f"{API}/teams/{org.blue.pk}/").status_code == 404
    members = alice.get(f"{API}/members/").json()["results"]
    assert {m["username"] for m in members} == {"alice", "arthur"}
    bobs = TeamMember.objects.get(user=org.bob)
    assert alice.get(f"{API}/members/{bobs.pk}/").status_code == 404
    assert alice.get(f"{API}/members/", {"team": org.blue.pk}).json()["results"] == []


def test_a_team_shows_its_budget_and_what_is_left_of_it_today(org):
    used(org.alice_key, "chat", today(), 300)
    used(org.alice_key, "chat", today() - timedelta(days=40), 5000)  # another month: not counted
    team = as_user(org.alice).get(f"{API}/teams/{org.red.pk}/").json()
    assert team["budgets"] == [{"name": "tokens per day", "limit": "1000", "used": "300", "left": "700"}]


def test_only_a_team_admin_adds_members_and_only_to_their_own_team(org):
    carol = person("carol", "carol@example.org")
    by_member = as_user(org.alice).post(f"{API}/members/", {"team": org.red.pk, "who": "carol"}, format="json")
    assert by_member.status_code == 404
    into_blue = as_user(org.arthur).post(f"{API}/members/", {"team": org.blue.pk, "who": "carol"}, format="json")
    assert into_blue.status_code == 404
    assert not TeamMember.objects.filter(user=carol).exists()
    added = as_user(org.arthur).post(
        f"{API}/members/", {"team": org.red.pk, "who": "carol@example.org", "role": "member"}, format="json"
    )
    assert added.status_code == 201, added.content
    assert added.json()["username"] == "carol"
    nobody = as_user(org.arthur).post(f"{API}/members/", {"team": org.red.pk, "who": "nobody"}, format="json")
    assert nobody.status_code == 400 and "Nobody here" in nobody.json()["detail"]


def test_a_team_admin_removes_a_member_but_not_one_the_provider_decides_nor_another_teams(org):
    alices = TeamMember.objects.get(user=org.alice)
    bobs = TeamMember.objects.get(user=org.bob)
    from_provider = TeamMember.objects.create(team=org.red, user=person("pat"), from_provider=True)
    arthur = as_user(org.arthur)
    assert arthur.delete(f"{API}/members/{bobs.pk}/").status_code == 404
    refused = arthur.delete(f"{API}/members/{from_provider.pk}/")
    assert refused.status_code == 400 and "identity provider" in refused.json()["detail"]
    assert as_user(org.alice).delete(f"{API}/members/{alices.pk}/").status_code == 404
    assert arthur.delete(f"{API}/members/{alices.pk}/").status_code == 204
    assert set(TeamMember.objects.values_list("user__username", flat=True)) == {"arthur", "bob", "pat"}


@pytest.fixture
def usage(org):
    used(org.alice_key, "chat", TODAY, 100, "0.01")
    used(org.alice_key, "embed", TODAY - timedelta(days=1), 40, "0.002")
    used(org.arthur_key, "chat", TODAY - timedelta(days=10), 60, "0.006")
    used(org.bob_key, "chat", TODAY, 999, "0.5")
    return org


def rows(response) -> list[tuple]:
    assert response.status_code == 200, response.content
    return sorted((r["key_name"], r["model"], r["day"]) for r in response.json()["results"])


def test_usage_is_a_persons_own_a_team_admins_teams_and_never_another_teams(usage):
    assert {r[0] for r in rows(as_user(usage.alice).get(f"{API}/usage/"))} == {"alice-laptop"}
    assert {r[0] for r in rows(as_user(usage.arthur).get(f"{API}/usage/"))} == {"alice-laptop", "arthur-notebook"}
    # Filters name another team's key or team: they narrow what one may see, never widen it.
    for guess in ({"key": usage.bob_key.pk}, {"team": usage.blue.pk}, {"person": "bob"}):
        assert rows(as_user(usage.alice).get(f"{API}/usage/", guess)) == []
        assert rows(as_user(usage.arthur).get(f"{API}/usage/", guess)) == []


def test_usage_filters_by_team_key_model_person_and_dates(usage):
    staff = person("sam", is_staff=True, is_superuser=True)
    client = as_user(staff)
    assert len(rows(client.get(f"{API}/usage/"))) == 4
    assert {r[0] for r in rows(client.get(f"{API}/usage/", {"team": usage.red.pk}))} == {
        "alice-laptop",
        "arthur-notebook",
    }
    assert rows(client.get(f"{API}/usage/", {"key": usage.bob_key.pk})) == [
        ("bob-secret-project", "chat", "2026-12-04")
    ]
    assert {r[1] for r in rows(client.get(f"{API}/usage/", {"model": "embed"}))} == {"embed"}
    assert {r[0] for r in rows(client.get(f"{API}/usage/", {"person": "arthur"}))} == {"arthur-notebook"}
    window = {"since": "2026-12-03", "until": "2026-12-03"}
    assert rows(client.get(f"{API}/usage/", window)) == [("alice-laptop", "embed", "2026-12-03")]
    spent = client.get(f"{API}/usage/", {"key": usage.alice_key.pk, "model": "chat"}).json()["results"][0]
    assert (spent["spend"], spent["team"], spent["person"]) == ("0.01000000", "red", "alice")
    bad = client.get(f"{API}/usage/", {"since": "yesterday"})
    assert bad.status_code == 400 and "since" in bad.json()


def read_csv(response) -> list[dict]:
    assert response.status_code == 200, response.content
    assert response["Content-Type"].startswith("text/csv")
    return list(csv.DictReader(io.StringIO(b"".join(response.streaming_content).decode())))


def test_the_usage_csv_has_every_row_the_filters_keep_and_only_the_readers_own(usage):
    whole = read_csv(as_user(usage.arthur).get(f"{API}/usage.csv"))
    assert sorted((r["key_name"], r["model"], r["day"]) for r in whole) == [
        ("alice-laptop", "chat", "2026-12-04"),
        ("alice-laptop", "embed", "2026-12-03"),
        ("arthur-notebook", "chat", "2026-11-24"),
    ]
    assert whole[0].keys() >= {"team", "person", "prompt_tokens", "completion_tokens", "cached_tokens", "spend"}
    since = read_csv(as_user(usage.arthur).get(f"{API}/usage.csv", {"since": "2026-12-01", "model": "chat"}))
    assert [(r["key_name"], r["spend"]) for r in since] == [("alice-laptop", "0.01000000")]
    assert read_csv(as_user(usage.alice).get(f"{API}/usage.csv", {"team": usage.blue.pk})) == []


def test_a_key_named_like_a_formula_is_text_in_the_csv(org):
    formula = key_of(org.alice, org.red, '=HYPERLINK("http://evil.example/","x")')
    used(formula, "chat", TODAY, 10)
    line = read_csv(as_user(org.alice).get(f"{API}/usage.csv"))[0]
    assert line["key_name"].startswith("'=HYPERLINK")


def test_a_teams_minute_budgets_left_are_read_live_from_the_limiters_counters_in_redis(org, redis_client, settings):
    org.red.requests_per_minute, org.red.tokens_per_minute, org.red.tokens_per_day = 10, 500, None
    org.red.save()
    clear_of_minute_boundary(10)

    async def use(key, requests: int, tokens: int) -> None:
        # As a gateway does: admitted by the limiter against the key's own limits and its team's budget.
        limiter = Limiter(settings.REDIS_URL)
        team = key.team
        budget = budget_of(team.pk, team.name, [getattr(team, name) for name in BUDGET_FIELDS])
        for _ in range(requests):
            ticket = await limiter.admit(tag_of(key.key_hash), None, budget)
            assert ticket is not None, "Redis answered the limiter"
            limiter.settle(ticket, tokens // requests)
        await limiter.close()  # sends the settlings and waits for their replies

    for key, requests, tokens in ((org.alice_key, 3, 120), (org.arthur_key, 1, 30), (org.bob_key, 9, 900)):
        asyncio.run(use(key, requests, tokens))
    budgets = as_user(org.alice).get(f"{API}/teams/{org.red.pk}/").json()["budgets"]
    # Alice's and Arthur's keys count; Bob's, of another team, does not.
    assert budgets == [
        {"name": "requests per minute", "limit": "10", "used": "4", "left": "6"},
        {"name": "tokens per minute", "limit": "500", "used": "150", "left": "350"},
    ]


def test_with_redis_away_a_minute_budget_says_it_is_not_known_and_the_rest_still_shows(org, settings):
    org.red.requests_per_minute = 10
    org.red.save()
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        settings.REDIS_URL = f"redis://127.0.0.1:{closed.getsockname()[1]}/0"  # bound, never listening: refused
        answer = as_user(org.alice).get(f"{API}/teams/{org.red.pk}/")
        page = Client()
        page.force_login(org.alice)
        shown = page.get("/me/").content.decode()
    assert answer.json()["budgets"] == [
        {"name": "requests per minute", "limit": "10", "used": None, "left": None},
        {"name": "tokens per day", "limit": "1000", "used": "0", "left": "1000"},
    ]
    assert "not known now" in shown
