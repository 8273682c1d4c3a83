"""Staff make an API key in the admin, in a real browser, and a client uses it against the gateway."""

import re

import pytest
import requests

from gateway.models import ApiKey

from .staff_browser import chromium_page, log_in_as_staff, screenshot

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

KEY = re.compile(r"llmgw-[A-Za-z0-9_-]{40,}")


def test_a_key_added_in_the_admin_is_shown_once_and_opens_the_gateway(live_server, gateway):
    with chromium_page() as page:
        log_in_as_staff(page, live_server)
        page.goto(live_server.url + "/admin/gateway/apikey/add/")
        page.fill("#id_name", "notebook")
        page.fill("#id_model_names", "[]")
        page.click("input[name=_save]")
        # Its own page (common.one_time), never a message: messages once lived in a cookie.
        shown = page.inner_text("#content")
        assert "shown on this page once" in shown and "notebook" in shown
        secret = KEY.search(shown).group(0)
        screenshot(page, "gateway-api-key")
        page.reload()
        assert secret not in page.content()

    answer = requests.get(gateway.url + "/v1/models", headers={"Authorization": f"Bearer {secret}"}, timeout=10)
    assert answer.status_code == 200 and answer.json()["object"] == "list"
    ApiKey.objects.filter(name="notebook").update(active=False)

    def refused():
        return requests.get(gateway.url + "/v1/models", headers={"Authorization": f"Bearer {secret}"}).status_code

    from .support.waiting import wait_until

    wait_until(lambda: refused() == 401, timeout=5, what="the turned-off key to be refused")
