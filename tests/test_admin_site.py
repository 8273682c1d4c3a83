"""The admin as llmgw's own: its name, its apps in the order work flows, plurals that read."""

import re

import pytest

pytestmark = pytest.mark.django_db


def test_the_admin_says_llmgw_and_lists_apps_in_the_order_work_flows(admin_client):
    html = admin_client.get("/admin/").content.decode()
    assert "<title>Mirror, catalog, fleet and gateway | llmgw</title>" in html
    assert '<a href="/admin/">llmgw</a>' in html
    captions = re.findall(r'<caption>\s*<a href="/admin/(\w+)/"', html)
    assert captions == ["mirror", "catalog", "fleet", "gateway", "auth", "auditlog"]


def test_fetches_are_called_fetches_and_tokens_sit_with_users(admin_client):
    html = admin_client.get("/admin/").content.decode()
    assert ">Fetches<" in html and "Fetchs" not in html
    auth = admin_client.get("/admin/auth/").content.decode()
    assert "/admin/accounts/apitoken/" in auth
    assert "/admin/accounts/" not in re.findall(r"<caption>.*?</caption>", html, re.S)[-1]
