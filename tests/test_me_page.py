"""/me/: a person's teams and budgets, their keys (made, shown once, revoked) and usage; a team admin's team.

The Django test client for the pages, attacked with guessed ids; one real browser for the whole
walk: sign in, make a key, see it once, and have the real llama-server answer through a real
gateway with it.
"""

import re
from datetime import timedelta

import pytest
from django.test import Client

from accounts.models import TeamMember
from gateway.keys import hash_key
from gateway.models import ApiKey
from people.budgets import today

from . import real_model
from .staff_browser import chromium_page, screenshot
from .support.gateway import client as gateway_client
from .support.gateway import until_routed
from .support.people import PASSWORD, key_of, person, two_teams, used
from .support.tiny_engine import serving_tiny_model

KEY = re.compile(r"llmgw-[A-Za-z0-9_-]{40,}")


@pytest.fixture
def org(db):
    return two_teams()


def as_user(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def text(response) -> str:
    return response.content.decode()


def test_a_stranger_is_sent_to_sign_in_and_a_local_account_lands_on_me(org):
    assert Client().get("/me/")["Location"].startswith("/me/login/?next=/me/")
    browser = Client()
    signed = browser.post("/me/login/?next=/me/", {"username": "alice", "password": PASSWORD, "next": "/me/"})
    assert signed.status_code == 302 and signed["Location"] == "/me/"
    page = browser.get("/me/")
    assert page.status_code == 200 and "alice-laptop" in text(page)
    # Nothing of the page is kept by a browser or a proxy.
    assert "no-store" in page["Cache-Control"]


def test_a_person_sees_their_teams_budget_left_their_keys_and_not_another_persons(org):
    used(org.alice_key, "chat", today(), 250, spend="0.0125")
    page = text(as_user(org.alice).get("/me/"))
    assert "This month: 250 tokens, spend 0.0125." in page
    assert "red" in page and "tokens per day" in page
    assert re.search(r'class="left">750<', page), "what is left of the day's 1000 tokens"
    assert "alice-laptop" in page
    # Arthur's key is in Alice's team but hers to see only as its admin; Bob's team is not hers at all.
    assert "arthur-notebook" not in page and "bob-secret-project" not in page and "blue" not in page


def test_a_team_admin_sees_the_teams_keys_members_and_usage_and_nothing_of_another_team(org):
    used(org.alice_key, "embed", today(), 40)
    used(org.bob_key, "chat", today(), 999)
    page = text(as_user(org.arthur).get("/me/"))
    assert "alice-laptop" in page and "arthur-notebook" in page
    assert "alice@example.org" in page and "Remove" in page
    assert "bob-secret-project" not in page and "bob@example.org" not in page
    # The team's chart draws Alice's embed tokens, not Bob's.
    assert 'data-tokens="40"' in page and 'data-tokens="999"' not in page


def test_a_key_made_on_me_is_shown_once_on_its_own_page_never_in_a_cookie(org):
    browser = as_user(org.alice)
    made = browser.post("/me/keys/", {"name": "alice-ci", "team": org.red.pk, "models": "chat", "expires": ""})
    assert made.status_code == 302 and made["Location"] == "/me/secret/"
    assert not any(KEY.search(morsel.value) for morsel in made.cookies.values())
    shown = browser.get("/me/secret/")
    secret = KEY.search(text(shown)).group(0)
    assert "no-store" in shown["Cache-Control"]
    key = ApiKey.objects.get(name="alice-ci")
    assert (key.key_hash, key.owner, key.team, key.model_names) == (hash_key(secret), org.alice, org.red, ["chat"])
    again = browser.get("/me/secret/")
    assert secret not in text(again) and "Nothing to show" in text(again)
    assert secret not in text(browser.get("/me/"))


def test_posting_another_teams_id_when_making_a_key_makes_nothing(org):
    before = ApiKey.objects.count()
    for team in (org.blue.pk, 999999, "x"):
        answer = as_user(org.alice).post("/me/keys/", {"name": "sneaky", "team": team})
        assert answer.status_code == 400
        assert "Select a valid choice" in text(answer)
    assert ApiKey.objects.count() == before


def test_a_model_outside_the_teams_or_a_taken_name_is_a_sentence_not_a_key(org):
    wide = as_user(org.alice).post("/me/keys/", {"name": "wide", "team": org.red.pk, "models": "chat, secret"})
    assert wide.status_code == 400 and "may not use secret" in text(wide)
    taken = as_user(org.alice).post("/me/keys/", {"name": "bob-secret-project", "team": org.red.pk})
    assert taken.status_code == 400 and "exists already" in text(taken)
    past = as_user(org.alice).post(
        "/me/keys/", {"name": "old", "team": org.red.pk, "expires": (today() - timedelta(days=1)).isoformat()}
    )
    assert past.status_code == 400 and "future" in text(past)
    assert not ApiKey.objects.filter(name__in=["wide", "old"]).exists()


def test_revoking_another_persons_key_by_its_guessed_id_is_a_404_and_the_key_stays_on(org):
    for attacker, victim in ((org.alice, org.bob_key), (org.alice, org.arthur_key), (org.arthur, org.bob_key)):
        assert as_user(attacker).post(f"/me/keys/{victim.pk}/revoke/").status_code == 404
        victim.refresh_from_db()
        assert victim.active
    assert as_user(org.alice).get(f"/me/keys/{org.alice_key.pk}/revoke/").status_code == 405


def test_revoking_ones_own_key_with_htmx_answers_its_row_struck_out(org):
    answer = as_user(org.alice).post(f"/me/keys/{org.alice_key.pk}/revoke/", headers={"HX-Request": "true"})
    assert answer.status_code == 200
    assert f'id="key-{org.alice_key.pk}"' in text(answer) and "revoked" in text(answer)
    org.alice_key.refresh_from_db()
    assert not org.alice_key.active
    # A team admin revokes a member's key of the team.
    extra = key_of(org.alice, org.red, "alice-extra")
    assert as_user(org.arthur).post(f"/me/keys/{extra.pk}/revoke/").status_code == 302
    extra.refresh_from_db()
    assert not extra.active


def test_a_team_admin_adds_by_email_and_removes_members_but_not_one_the_provider_decides(org):
    person("carol", "carol@example.org")
    arthur = as_user(org.arthur)
    form = f"team{org.red.pk}"
    assert (
        arthur.post(
            f"/me/teams/{org.red.pk}/members/", {f"{form}-who": "carol@example.org", f"{form}-role": "member"}
        ).status_code
        == 302
    )
    assert TeamMember.objects.filter(team=org.red, user__username="carol").exists()
    pat = TeamMember.objects.create(team=org.red, user=person("pat"), from_provider=True)
    refused = arthur.post(f"/me/members/{pat.pk}/remove/")
    assert refused.status_code == 400 and "identity provider" in text(refused)
    alices = TeamMember.objects.get(user=org.alice)
    assert arthur.post(f"/me/members/{alices.pk}/remove/").status_code == 302
    assert not TeamMember.objects.filter(pk=alices.pk).exists()


def test_a_member_or_another_teams_admin_cannot_change_a_teams_members(org):
    person("carol")
    blue = f"team{org.blue.pk}"
    red = f"team{org.red.pk}"
    into_blue = as_user(org.arthur).post(
        f"/me/teams/{org.blue.pk}/members/", {f"{blue}-who": "carol", f"{blue}-role": "admin"}
    )
    by_member = as_user(org.alice).post(
        f"/me/teams/{org.red.pk}/members/", {f"{red}-who": "carol", f"{red}-role": "admin"}
    )
    assert (into_blue.status_code, by_member.status_code) == (404, 404)
    bobs = TeamMember.objects.get(user=org.bob)
    arthurs = TeamMember.objects.get(user=org.arthur)
    assert as_user(org.arthur).post(f"/me/members/{bobs.pk}/remove/").status_code == 404
    assert as_user(org.alice).post(f"/me/members/{arthurs.pk}/remove/").status_code == 404
    assert TeamMember.objects.filter(user__username="carol").count() == 0
    assert TeamMember.objects.filter(pk__in=[bobs.pk, arthurs.pk]).count() == 2


def test_the_usage_chart_has_a_bar_a_day_split_by_model(org):
    used(org.alice_key, "chat", today(), 300)
    used(org.alice_key, "embed", today(), 100)
    used(org.alice_key, "chat", today() - timedelta(days=2), 200)
    page = text(as_user(org.alice).get("/me/"))
    chart = page[page.index("Your usage") :]
    assert chart.count('<g class="day"') == 30
    assert f'data-day="{today().isoformat()}" data-tokens="400"' in chart
    heights = [float(h) for h in re.findall(r'<rect [^>]*height="([\d.]+)"', chart)]
    # The busiest day is the chart's full height: 300 and 100 of 400 tokens, then 200 of 400.
    assert sorted(heights) == [50.0, 100.0, 150.0]
    assert "Most in a day: 400 tokens" in chart


# --- the whole walk, in a real browser, to the real engine -------------------------------------------


@pytest.mark.browser
@pytest.mark.engine
@pytest.mark.django_db(transaction=True)
def test_a_person_signs_in_makes_a_key_on_me_sees_it_once_and_the_real_engine_answers_with_it(
    live_server, gateway, tmp_path, tiny_gguf
):
    org = two_teams()
    org.red.model_names = [real_model.MODEL]
    org.red.tokens_per_day = None
    org.red.save()
    with serving_tiny_model(tiny_gguf, tmp_path):
        with chromium_page() as page:
            page.goto(live_server.url + "/me/")
            page.fill("#id_username", "alice")
            page.fill("#id_password", PASSWORD)
            page.click("input[type=submit]")
            page.wait_for_url(live_server.url + "/me/")
            page.fill("#id_name", "alice-browser")
            page.select_option("#id_team", label="red")
            page.click("#make-key input[type=submit]")
            page.wait_for_url(live_server.url + "/me/secret/")
            shown = page.inner_text("#one-time-secrets")
            secret = KEY.search(shown).group(0)
            screenshot(page, "me-key-shown-once")
            page.reload()
            assert secret not in page.content()
            page.goto(live_server.url + "/me/")
            assert "alice-browser" in page.inner_text("#my-keys")
            screenshot(page, "me-page")

        session = gateway_client(secret)
        until_routed(session, gateway.url, real_model.MODEL)
        body = {"model": real_model.MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        answer = session.post(gateway.url + "/v1/chat/completions", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["role"] == "assistant"
        assert answer.json()["usage"]["completion_tokens"] > 0
        # Bob, of another team, holds no key that opens it and cannot revoke Alice's.
        key = ApiKey.objects.get(name="alice-browser")
        assert as_user(org.bob).post(f"/me/keys/{key.pk}/revoke/").status_code == 404
        assert "alice-browser" not in text(as_user(org.bob).get("/me/"))
