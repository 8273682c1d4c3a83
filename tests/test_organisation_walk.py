"""Issue 35's walk for a whole organisation, in a real browser: people of two teams sign in through the
organisation's identity provider, make keys for themselves on /me/, and the real llama-server answers
one team's key; the other team's person can neither see, revoke nor read that key, and their own key
does not open the first team's model.

The provider is the tests' OIDC provider in a process of its own (tests/support/oidc.py); llmgw's pages
are `manage.py admin_server` and the /v1/ API a real gateway process, both on the test database.
"""

from __future__ import annotations

import re

import pytest

from accounts.models import Team
from gateway.keys import hash_key
from gateway.models import ApiKey

from . import real_model
from .staff_browser import screenshot
from .support import oidc
from .support.gateway import client as gateway_client
from .support.gateway import error_of, until_routed
from .support.oidc import PASSWORD, consent, signed_in_as, start_admin_signing_in_through, start_sign_in
from .support.tiny_engine import serving_tiny_model
from .support.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

# The shared fixtures (one provider and one browser for the module), where pytest looks for them.
provider, browser_page, page = oidc.provider, oidc.browser_page, oidc.page

KEY = re.compile(r"llmgw-[A-Za-z0-9_-]{40,}")
# A model of blue's list that is not served here: blue's keys may use it and nothing else.
BLUES_MODEL = "blue-chat"


@pytest.fixture(scope="module")
def admin(provider, tmp_path_factory, django_db_setup) -> str:
    """llmgw's admin server signing in through the provider: its URL."""
    process, url = start_admin_signing_in_through(provider, tmp_path_factory.mktemp("admin-walk"))
    yield url
    process.stop()


def sign_in_on_me(page, admin: str, provider, username: str) -> None:
    """A person not signed in opens /me/, is sent to sign in, chooses the provider, consents and is back on /me/."""
    page.context.clear_cookies()
    page.goto(admin + "/me/")
    page.wait_for_url(admin + "/me/login/**")
    start_sign_in(page, admin, provider, username, start=page.url.removeprefix(admin))
    consent(page, provider)
    page.wait_for_url(admin + "/me/")


def make_key(page, admin: str, name: str, team: str) -> str:
    """A key made with /me/'s form for `team`: the secret its one-time page shows."""
    page.fill("#id_name", name)
    page.select_option("#id_team", label=team)
    page.click("#make-key input[type=submit]")
    page.wait_for_url(admin + "/me/secret/")
    return KEY.search(page.inner_text("#one-time-secrets")).group(0)


def post_as_the_browser(page, url: str):
    """A POST from this browser's session, with the CSRF token its pages' forms carry."""
    token = next(c["value"] for c in page.context.cookies(url) if c["name"] == "csrftoken")
    return page.request.post(url, headers={"X-CSRFToken": token, "Referer": url}, max_redirects=0)


@pytest.mark.browser
@pytest.mark.engine
def test_a_person_signs_in_through_the_provider_makes_a_key_on_me_and_gets_an_answer_another_team_cannot_reach(
    page, provider, admin, gateway, tmp_path, tiny_gguf
):
    Team.objects.create(name="red", model_names=[real_model.MODEL])
    Team.objects.create(name="blue", model_names=[BLUES_MODEL])
    provider.set(
        users=[
            {"username": "alice", "password": PASSWORD, "groups": ["llmgw-team-red"]},
            {"username": "bob", "password": PASSWORD, "groups": ["llmgw-team-blue"]},
        ]
    )
    with serving_tiny_model(tiny_gguf, tmp_path):
        sign_in_on_me(page, admin, provider, "alice")
        alice = signed_in_as(page, admin)
        assert alice.username == "alice"
        # The provider's group made her a member of red, and red only.
        assert page.locator("section.team h3").all_inner_texts() == ["red (member)"]
        secret = make_key(page, admin, "alice-walk", "red")
        screenshot(page, "walk-key-shown-once")
        key = ApiKey.objects.get(name="alice-walk")
        assert (key.key_hash, key.owner, key.team.name) == (hash_key(secret), alice, "red")

        session = gateway_client(secret)
        until_routed(session, gateway.url, real_model.MODEL)
        body = {"model": real_model.MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        answer = session.post(gateway.url + "/v1/chat/completions", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["role"] == "assistant"
        assert answer.json()["usage"]["completion_tokens"] > 0
        # Alice reads her key in the API: the address Bob guesses below is a real one.
        assert page.request.get(f"{admin}/api/people/keys/{key.pk}/").status == 200

        sign_in_on_me(page, admin, provider, "bob")
        bob = signed_in_as(page, admin)
        assert bob.username == "bob" and bob != alice
        assert page.locator("section.team h3").all_inner_texts() == ["blue (member)"]
        assert "alice-walk" not in page.content()
        bobs_secret = make_key(page, admin, "bob-walk", "blue")
        page.goto(admin + "/me/")
        assert "bob-walk" in page.inner_text("#my-keys")
        assert "alice-walk" not in page.content()
        screenshot(page, "walk-another-team")

        # Bob guesses Alice's key's id: revoking it on /me/ or in the API and reading it there are "not found".
        assert post_as_the_browser(page, f"{admin}/me/keys/{key.pk}/revoke/").status == 404
        assert page.request.get(f"{admin}/api/people/keys/{key.pk}/").status == 404
        assert post_as_the_browser(page, f"{admin}/api/people/keys/{key.pk}/revoke/").status == 404
        key.refresh_from_db()
        assert key.active
        assert session.post(gateway.url + "/v1/chat/completions", json=body, timeout=120).status_code == 200

        # Bob's own key does not open red's model.
        bobs = gateway_client(bobs_secret)
        wait_until(
            lambda: bobs.get(gateway.url + "/v1/models", timeout=30).status_code == 200,
            timeout=10,
            what="the gateway to know Bob's new key",
        )
        refused = bobs.post(gateway.url + "/v1/chat/completions", json=body, timeout=30)
        assert refused.status_code == 403, refused.text
        assert error_of(refused)["code"] == "model_not_allowed"

        # The same browser, the same way, revokes Bob's own key: the 404 above was Alice's key, not the request.
        bobs_key = ApiKey.objects.get(name="bob-walk")
        assert post_as_the_browser(page, f"{admin}/me/keys/{bobs_key.pk}/revoke/").status == 302
        bobs_key.refresh_from_db()
        assert not bobs_key.active
