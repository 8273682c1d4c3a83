"""The test OIDC provider as the browser tests drive it: its fixtures, llmgw's admin server signing in
through it, and a person's way through its pages (login form, consent)."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.contrib.sessions.models import Session

from ..staff_browser import chromium_page
from .oidc_provider.start import start_provider
from .processes import start_admin_server

CLIENT_ID = "llmgw"
CLIENT_SECRET = "llmgw's secret at the test provider"
PASSWORD = "a password at the provider"
PROVIDER_NAME = "Test provider"


def oidc_env(issuer: str, renew_s: int | None = None) -> dict[str, str]:
    """The LLMGW_OIDC_* settings an operator gives llmgw for this provider."""
    env = {
        "LLMGW_OIDC_ISSUER": issuer,
        "LLMGW_OIDC_CLIENT_ID": CLIENT_ID,
        "LLMGW_OIDC_CLIENT_SECRET": CLIENT_SECRET,
        "LLMGW_OIDC_PROVIDER_NAME": PROVIDER_NAME,
        "LLMGW_OIDC_STAFF_GROUPS": "llmgw-staff",
        "LLMGW_OIDC_OPERATOR_GROUPS": "llmgw-operators",
        "LLMGW_OIDC_TEAM_PREFIX": "llmgw-team-",
        "LLMGW_OIDC_TEAM_ADMIN_SUFFIX": "-admins",
    }
    if renew_s is not None:
        env["LLMGW_OIDC_RENEW_S"] = str(renew_s)
    return env


@pytest.fixture(scope="module")
def provider(tmp_path_factory):
    running = start_provider(tmp_path_factory.mktemp("oidc-provider"))
    yield running
    running.stop()


def start_admin_signing_in_through(provider, log_dir, renew_s: int | None = None):
    """llmgw's admin server signing in through the provider, which knows it as a client: (process, its URL)."""
    process, url = start_admin_server(log_dir, **oidc_env(provider.issuer, renew_s))
    provider.set(
        client={"client_id": CLIENT_ID, "client_secret": CLIENT_SECRET, "redirect_uri": url + "/oidc/callback/"}
    )
    return process, url


@pytest.fixture(scope="module")
def browser_page():
    with chromium_page() as page:
        yield page


@pytest.fixture
def page(browser_page):
    """The module's browser with no cookies: signed in nowhere, at llmgw or the provider."""
    browser_page.context.clear_cookies()
    return browser_page


def start_sign_in(
    page, admin: str, provider, username: str, password: str = PASSWORD, start: str = "/admin/login/?next=/admin/"
) -> None:
    """From one of llmgw's login pages (`start`) to the provider's, and its login form filled and sent."""
    page.goto(admin + start)
    page.get_by_role("link", name=f"Sign in with {PROVIDER_NAME}").click()
    page.wait_for_url(provider.url + "/accounts/login/**")
    page.fill("#id_username", username)
    page.fill("#id_password", password)
    page.click("button[type=submit]")


def consent(page, provider) -> str:
    """The provider's consent screen, allowed: the permissions it listed."""
    page.wait_for_url(provider.url + "/o/authorize/**")
    asked = page.locator("#authorizationForm").inner_text()
    page.click("input[name=allow]")
    return asked


def signed_in_as(page, admin: str):
    """The user llmgw's session cookie in this browser is signed in as, or None."""
    cookie = next((c for c in page.context.cookies(admin) if c["name"] == "sessionid"), None)
    session = Session.objects.filter(pk=cookie["value"]).first() if cookie else None
    user_id = session.get_decoded().get("_auth_user_id") if session else None
    return get_user_model().objects.filter(pk=user_id).first() if user_id else None
