"""Debian's chromium driven by Playwright, against pytest-django's live server."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from django.contrib.auth import get_user_model

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
PASSWORD = "a long staff password"


@contextmanager
def chromium_page() -> Iterator:
    """A fresh chromium page; closed, with its browser, at the end."""
    from playwright.sync_api import sync_playwright

    # The sync API runs an event loop in this thread; the ORM calls the tests
    # make between page actions are synchronous and safe here.
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
        try:
            page = browser.new_context(viewport={"width": 1280, "height": 1000}).new_page()
            page.set_default_timeout(15_000)
            yield page
        finally:
            browser.close()


def log_in_as_staff(page, live_server, username: str = "ann") -> None:
    """Log in to the admin the way a person does it (the user is made here)."""
    get_user_model().objects.create_superuser(username, "", PASSWORD)
    page.goto(live_server.url + "/admin/login/")
    page.fill("#id_username", username)
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    page.wait_for_url(live_server.url + "/admin/")


def screenshot(page, name: str) -> Path:
    """Kept under test-artifacts/ for a person to look at."""
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path
