"""Sign-in with the organisation's OpenID Connect provider, in a real browser, against a real provider.

The provider is django-oauth-toolkit with OIDC on, in a process of its own
(tests/support/oidc_provider/), with a consent screen; llmgw is `manage.py admin_server`
given the LLMGW_OIDC_* settings an operator would. One provider, one admin server and one
browser serve the module.
"""

from __future__ import annotations

import subprocess
import sys
from urllib.parse import urlsplit

import pytest
import requests
from django.contrib.auth import get_user_model
from django.contrib.sessions.models import Session

from accounts import sign_in
from accounts.models import ProviderAccount, Team, TeamMember
from common.permissions import OPERATORS, VIEWERS

from .services import free_port
from .staff_browser import PASSWORD as LOCAL_PASSWORD
from .support import oidc
from .support.oidc import (
    PASSWORD,
    PROVIDER_NAME,
    consent,
    oidc_env,
    signed_in_as,
    start_admin_signing_in_through,
    start_sign_in,
)
from .support.processes import BASE_DIR, process_env, start_admin_server
from .support.roles import groups
from .support.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

# The shared fixtures (one provider and one browser for the module), where pytest looks for them.
provider, browser_page, page = oidc.provider, oidc.browser_page, oidc.page
# Short, so the test sees a disabled person lose the pages; long enough that most steps do not refresh.
RENEW_S = 3
MAPPING = sign_in.Mapping(
    staff_groups=frozenset({"llmgw-staff"}),
    operator_groups=frozenset({"llmgw-operators"}),
    team_prefix="llmgw-team-",
    team_admin_suffix="-admins",
)


@pytest.fixture(scope="module")
def admin(provider, tmp_path_factory, django_db_setup) -> str:
    """llmgw's admin server signing in through the provider, which knows it as a client: its URL."""
    process, url = start_admin_signing_in_through(provider, tmp_path_factory.mktemp("admin-oidc"), RENEW_S)
    yield url
    process.stop()


def memberships(user) -> set[tuple[str, str, bool]]:
    return {(m.team.name, m.role, m.from_provider) for m in TeamMember.objects.filter(user=user)}


@pytest.mark.browser
def test_a_person_signs_in_through_the_provider_with_consent_and_their_groups_make_them_staff_and_team_members(
    page, provider, admin
):
    groups()
    Team.objects.create(name="research")
    Team.objects.create(name="ops")
    provider.set(
        users=[
            {
                "username": "pia",
                "password": PASSWORD,
                "email": "pia@example.org",
                "first_name": "Pia",
                "groups": [
                    "llmgw-staff",
                    "llmgw-team-research",
                    "llmgw-team-ops-admins",
                    "llmgw-team-ghost",
                    "payroll",
                ],
            }
        ]
    )
    start_sign_in(page, admin, provider, "pia")
    asked = consent(page, provider)
    assert "The groups you are in" in asked and "Your email address" in asked
    page.wait_for_url(admin + "/admin/")
    assert "Pia" in page.locator("#user-tools").text_content()

    pia = get_user_model().objects.get(username="pia")
    assert signed_in_as(page, admin) == pia
    assert ProviderAccount.objects.get(user=pia).issuer == provider.issuer
    assert pia.email == "pia@example.org"
    assert pia.is_staff and not pia.is_superuser
    assert set(pia.groups.values_list("name", flat=True)) == {VIEWERS}
    assert memberships(pia) == {("research", "member", True), ("ops", "admin", True)}
    # A group naming a team llmgw does not have makes no team (a team without budgets).
    assert not Team.objects.filter(name="ghost").exists()


@pytest.mark.browser
def test_a_person_removed_from_a_group_at_the_provider_loses_that_team_at_their_next_sign_in_and_keeps_one_made_by_hand(
    page, provider, admin
):
    groups()
    research = Team.objects.create(name="research")
    ops = Team.objects.create(name="ops")
    provider.set(users=[{"username": "noor", "password": PASSWORD, "groups": ["llmgw-team-research"]}])
    start_sign_in(page, admin, provider, "noor")
    consent(page, provider)
    # Not staff: their own page, not the admin they were on the way to.
    page.wait_for_url(admin + "/me/")
    noor = get_user_model().objects.get(username="noor")
    assert signed_in_as(page, admin) == noor
    assert not noor.is_staff and not noor.groups.exists()
    assert memberships(noor) == {("research", "member", True)}
    TeamMember.objects.create(team=ops, user=noor, role=TeamMember.Role.MEMBER)

    provider.set(users=[{"username": "noor", "groups": []}])
    page.context.clear_cookies()
    start_sign_in(page, admin, provider, "noor")
    page.wait_for_url(admin + "/me/")
    assert signed_in_as(page, admin) == noor
    assert memberships(noor) == {("ops", "member", False)}
    assert research.members.count() == 0


@pytest.mark.browser
def test_a_person_disabled_at_the_provider_loses_the_pages_at_the_next_refresh_and_cannot_sign_in_again(
    page, provider, admin
):
    groups()
    provider.set(users=[{"username": "sam", "password": PASSWORD, "groups": ["llmgw-operators"]}])
    start_sign_in(page, admin, provider, "sam")
    consent(page, provider)
    page.wait_for_url(admin + "/admin/")
    sam = get_user_model().objects.get(username="sam")
    assert sam.is_staff and set(sam.groups.values_list("name", flat=True)) == {OPERATORS}

    # While enabled, the refresh is silent (no page at the provider) and reads the groups again.
    infra = Team.objects.create(name="infra")
    provider.set(users=[{"username": "sam", "groups": ["llmgw-operators", "llmgw-team-infra"]}])

    def fragment_reloads_its_page() -> bool:
        # A fragment's own request (htmx) cannot follow the provider's redirect: its page is reloaded instead.
        answer = page.request.get(admin + "/admin/", headers={"HX-Request": "true"}, max_redirects=0)
        assert answer.status in (200, 204), answer.status
        return answer.status == 204 and answer.headers.get("hx-refresh") == "true"

    wait_until(fragment_reloads_its_page, timeout=RENEW_S + 30, interval=0.5, what="the session to be due a refresh")

    def refreshed() -> bool:
        page.goto(admin + "/admin/")
        assert page.url == admin + "/admin/", page.url
        return infra.members.filter(user=sam).exists()

    wait_until(refreshed, timeout=RENEW_S + 30, interval=0.5, what="sam's session to be refreshed at the provider")
    assert signed_in_as(page, admin) == sam

    provider.set(users=[{"username": "sam", "active": False}])

    def sent_away() -> bool:
        page.goto(admin + "/admin/")
        return page.url.startswith(admin + "/admin/login/")

    # Within LLMGW_OIDC_RENEW_S the next page goes back to the provider, which no longer signs sam in.
    wait_until(sent_away, timeout=RENEW_S + 30, interval=0.5, what="the disabled person to be sent to the login page")
    said = page.locator(".messagelist, #content").first.inner_text()
    assert "no longer confirms your sign-in" in said, f"{page.url} says: {said}"
    assert signed_in_as(page, admin) is None

    start_sign_in(page, admin, provider, "sam")
    refused = page.wait_for_selector(".errorlist.nonfield")
    assert "correct username and password" in refused.inner_text()
    assert page.url.startswith(provider.url + "/accounts/login/")
    assert signed_in_as(page, admin) is None


def log_in_locally(url: str, username: str) -> requests.Session:
    """A local account's password login on the admin's form, as a browser sends it: the signed-in session."""
    browser = requests.Session()
    browser.get(url + "/admin/login/", timeout=30)
    signed = browser.post(
        url + "/admin/login/?next=/admin/",
        data={
            "username": username,
            "password": LOCAL_PASSWORD,
            "next": "/admin/",
            "csrfmiddlewaretoken": browser.cookies["csrftoken"],
        },
        headers={"Referer": url + "/admin/login/"},
        timeout=30,
    )
    assert urlsplit(signed.url).path == "/admin/" and "Log out" in signed.text, signed.text[:2000]
    return browser


def test_an_answer_to_no_sign_in_started_in_this_browser_signs_nobody_in_and_nobody_out(provider, admin):
    """A code stolen from someone's redirect, replayed from another browser, signs nobody in;
    a link to the callback made by someone else signs nobody out."""
    stranger = requests.Session()
    answer = stranger.get(admin + "/oidc/callback/?code=stolen-code&state=guessed-state", timeout=30)
    assert answer.status_code == 200
    assert urlsplit(answer.url).path == "/admin/login/"
    assert "belongs to no sign-in started in this browser" in answer.text
    assert "Traceback" not in answer.text
    session = Session.objects.filter(pk=stranger.cookies.get("sessionid")).first()
    assert session is None or "_auth_user_id" not in session.get_decoded()

    get_user_model().objects.create_superuser("root", "", LOCAL_PASSWORD)
    person = log_in_locally(admin, "root")
    person.get(admin + "/oidc/callback/?error=login_required&state=guessed-state", timeout=30)
    assert "Log out" in person.get(admin + "/admin/", timeout=30).text


def test_with_the_provider_away_its_sign_in_says_so_and_a_local_account_still_signs_in(tmp_path):
    get_user_model().objects.create_superuser("root", "", LOCAL_PASSWORD)
    nowhere = f"http://127.0.0.1:{free_port()}/o"
    process, url = start_admin_server(tmp_path, **oidc_env(nowhere))
    try:
        browser = requests.Session()
        login = browser.get(url + "/admin/login/", timeout=30)
        assert f"Sign in with {PROVIDER_NAME}" in login.text
        away = browser.get(url + "/oidc/authenticate/", timeout=30)
        assert urlsplit(away.url).path == "/admin/login/"
        assert f"Sign-in with {PROVIDER_NAME} is not available now" in away.text
        log_in_locally(url, "root")
    finally:
        process.stop()


def test_without_an_issuer_there_is_no_provider_and_the_login_is_local_accounts_alone(client):
    login = client.get("/admin/login/")
    assert login.status_code == 200
    assert "Sign in with" not in login.content.decode()
    assert client.get("/oidc/authenticate/").status_code == 404
    assert client.get("/oidc/callback/?code=x&state=y").status_code == 404


@pytest.mark.parametrize(
    "env, sentence",
    [
        (
            {"LLMGW_OIDC_ISSUER": "http://login.example.org/o"},
            "LLMGW_OIDC_ISSUER must be the provider's https:// address",
        ),
        (
            {"LLMGW_OIDC_ISSUER": "https://login.example.org/o"},
            "LLMGW_OIDC_ISSUER is set, so LLMGW_OIDC_CLIENT_ID and LLMGW_OIDC_CLIENT_SECRET must be too",
        ),
    ],
)
def test_a_wrong_provider_setting_is_one_sentence_and_a_failed_start(tmp_path, env, sentence):
    done = subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=BASE_DIR,
        env=process_env(LLMGW_VAR=str(tmp_path), **env),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert sentence in done.stderr
    assert "Traceback" not in done.stderr


def test_group_names_map_to_team_roles_with_the_admin_group_winning():
    roles = sign_in.team_roles(
        frozenset({"llmgw-team-a", "llmgw-team-b-admins", "llmgw-team-a-admins", "llmgw-team-", "other-c"}), MAPPING
    )
    assert roles == {"a": "admin", "b": "admin", "b-admins": "member", "a-admins": "member"}
    assert sign_in.staff_roles(frozenset({"llmgw-operators"}), MAPPING) == (False, True)
    assert sign_in.groups_of({"groups": "llmgw-staff"}, "groups") == {"llmgw-staff"}
    assert sign_in.groups_of({"groups": {"not": "a list"}}, "groups") == frozenset()
    # accounts sits below common, so it names the staff groups itself: they must stay the same names.
    assert (sign_in.VIEWERS, sign_in.OPERATORS) == (VIEWERS, OPERATORS)


def test_a_provider_person_named_like_a_local_account_gets_a_new_user_and_never_that_account():
    """The break-glass admin is not taken over by someone the provider calls "root" with its email."""
    groups()
    root = get_user_model().objects.create_superuser("root", "root@example.org", LOCAL_PASSWORD)
    claims = {"sub": "42", "preferred_username": "root", "email": "root@example.org", "groups": ["llmgw-staff"]}
    assert sign_in.find_user("https://login.example.org", claims) is None
    person = sign_in.apply_claims(sign_in.make_user("https://login.example.org", claims), claims, "groups", MAPPING)
    assert person.pk != root.pk and person.username == "root-2" and not person.is_superuser
    assert sign_in.find_user("https://login.example.org", claims) == person
    # The same subject at another provider is another person.
    assert sign_in.find_user("https://other.example.org", claims) is None
    root.refresh_from_db()
    assert root.is_superuser and not root.groups.exists()
