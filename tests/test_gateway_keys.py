"""API keys as staff make them: `manage.py api_key` and the admin; shown once, stored as a hash."""

from __future__ import annotations

import datetime
import io

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from gateway.keys import hash_key
from gateway.models import ApiKey, Usage

pytestmark = pytest.mark.django_db


def api_key(*args) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    call_command("api_key", *args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def test_create_prints_the_key_once_on_stdout_and_keeps_only_its_hash():
    out, err = api_key("create", "alice", "--model", "llama-3", "--model", "qwen")
    secret = out.strip()
    assert out.count("\n") == 1 and secret.startswith("llmgw-") and len(secret) > 40
    assert "shown this once" in err and secret not in err
    key = ApiKey.objects.get(name="alice")
    assert key.key_hash == hash_key(secret) and secret not in key.key_hash
    assert key.prefix == secret[:12] and key.model_names == ["llama-3", "qwen"]


def test_list_never_shows_a_key_and_revoke_turns_one_off():
    secret = api_key("create", "bob")[0].strip()
    listed = api_key("list")[0]
    assert "bob" in listed and secret not in listed and "every model" in listed
    api_key("revoke", "bob")
    assert ApiKey.objects.get(name="bob").active is False


def test_a_duplicate_name_or_an_unknown_key_is_a_sentence_not_a_traceback():
    api_key("create", "carol")
    with pytest.raises(CommandError, match="There is already a key named 'carol'"):
        api_key("create", "carol")
    with pytest.raises(CommandError, match="There is no key named 'dave'"):
        api_key("revoke", "dave")


# The usage inline's management form, which every admin form post carries.
NO_USAGE_ROWS = {"usage-TOTAL_FORMS": "0", "usage-INITIAL_FORMS": "0"}


def test_a_key_added_in_the_admin_is_shown_once_and_works_by_its_hash(staff_client):
    added = staff_client.post(
        "/admin/gateway/apikey/add/",
        {"name": "eve", "model_names": '["chat"]', "active": "on", **NO_USAGE_ROWS},
        follow=True,
    )
    assert added.status_code == 200
    # On its own page (common.one_time), never in the messages.
    shown = [item["secret"] for item in added.context["secrets"]]
    assert len(shown) == 1
    secret = shown[0]
    key = ApiKey.objects.get(name="eve")
    assert key.key_hash == hash_key(secret) and key.created_by == "ann" and key.model_names == ["chat"]
    # Shown once: the key's own page never has it again.
    page = staff_client.get(f"/admin/gateway/apikey/{key.pk}/change/")
    assert secret not in page.content.decode() and key.prefix in page.content.decode()


def test_the_admin_refuses_models_that_are_not_a_list_of_names(staff_client):
    page = staff_client.post(
        "/admin/gateway/apikey/add/", {"name": "frank", "model_names": '"chat"', "active": "on", **NO_USAGE_ROWS}
    )
    assert page.status_code == 200
    assert "Write the models as a list of names" in page.content.decode()
    assert not ApiKey.objects.filter(name="frank").exists()


def test_usage_shows_on_the_keys_page_and_cannot_be_edited(staff_client):
    out = api_key("create", "grace")[0]
    key = ApiKey.objects.get(name="grace")
    Usage.objects.create(
        key=key, model_name="chat", day=datetime.date(2026, 11, 29), requests=3, prompt_tokens=33, completion_tokens=9
    )
    page = staff_client.get(f"/admin/gateway/apikey/{key.pk}/change/").content.decode()
    assert "chat" in page and ">33<" in page and out.strip() not in page
    listing = staff_client.get("/admin/gateway/usage/").content.decode()
    assert "grace" in listing and ">42<" in listing
    assert staff_client.get("/admin/gateway/usage/add/").status_code == 403
