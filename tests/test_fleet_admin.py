"""Enrolling a node and reading the catalog in the admin, in a real browser."""

import re

import pytest

from catalog.models import Model, Profile
from fleet.enrolment import node_for_token
from fleet.models import Node

from .staff_browser import screenshot

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

TOKEN = re.compile(r"llmgw-node-[A-Za-z0-9_-]{40,}")


def test_adding_a_node_shows_its_enrolment_token_once(staff_page, live_server):
    page = staff_page
    page.goto(live_server.url + "/admin/fleet/node/add/")
    page.fill("#id_name", "gpu-01")
    page.click("input[name=_save]")
    # Its own page (common.one_time), never a message: messages once lived in a cookie.
    shown = page.inner_text("#content")
    token = TOKEN.search(shown).group(0)
    assert "shown on this page once" in shown and "node gpu-01" in shown
    assert node_for_token(token).name == "gpu-01"
    screenshot(page, "fleet-node-token")
    page.reload()
    assert token not in page.content()


def test_the_token_action_replaces_a_nodes_token(staff_page, live_server):
    page = staff_page
    node = Node.objects.create(name="cpu-01", token_hash="0" * 64, memory_gb=32, engines=["llamacpp"])
    page.goto(live_server.url + "/admin/fleet/node/")
    page.check(f"input[name=_selected_action][value='{node.pk}']")
    page.select_option("select[name=action]", "make_token")
    page.click("button[name=index]")
    token = TOKEN.search(page.inner_text("#one-time-secrets")).group(0)
    assert node_for_token(token, claimed_name="cpu-01") is not None
    page.goto(live_server.url + "/admin/fleet/node/")
    assert "not ready" in page.inner_text("#result_list")


def test_a_declared_model_is_read_only_in_the_admin(staff_page, live_server):
    page = staff_page
    model = Model.objects.create(
        name="decl", source="http://127.0.0.1:8001/d/v/", context_length=1, declared=True, added_by="configuration"
    )
    Profile.objects.create(model=model, name="cpu", engine="llamacpp")
    page.goto(f"{live_server.url}/admin/catalog/model/{model.pk}/change/")
    assert "Declared in configuration (LLMGW_CATALOG): decl is edited there" in page.inner_text(".messagelist")
    assert page.locator("input[name=_save]").count() == 0
    assert page.locator("#id_name").count() == 0
    screenshot(page, "catalog-declared-read-only")


def test_a_node_name_that_cannot_be_a_queue_is_refused_in_the_admin(staff_page, live_server):
    page = staff_page
    page.goto(live_server.url + "/admin/fleet/node/add/")
    page.fill("#id_name", "gpu 01/a")
    page.click("input[name=_save]")
    assert "is not a node name: use up to 100 letters" in page.inner_text(".errorlist")
    assert not Node.objects.exists()


def test_a_model_added_in_the_admin_needs_a_profile_and_records_who_added_it(staff_page, live_server):
    page = staff_page
    page.goto(live_server.url + "/admin/catalog/model/add/")
    page.fill("#id_name", "by-hand")
    page.fill("#id_source", "http://elsewhere.example/by-hand/v1/")
    page.fill("#id_context_length", "2048")
    page.click("input[name=_save]")
    assert "the source must be an address on the byte listener" in page.inner_text("#content")
    page.fill("#id_source", "http://127.0.0.1:8001/by-hand/v1/")
    page.click("input[name=_save]")
    assert "This field is required." in page.inner_text("#profiles-0")
    assert not Model.objects.exists()
    page.fill("#id_profiles-0-name", "cpu")
    page.select_option("#id_profiles-0-engine", "llamacpp")
    page.click("input[name=_save]")
    page.wait_for_url(live_server.url + "/admin/catalog/model/")
    model = Model.objects.get(name="by-hand")
    assert (model.added_by, model.declared, model.profiles.get().engine) == ("ann", False, "llamacpp")
