"""The audit log (docs/audit.md): who changed what, before and after, from where, whatever the door; nobody edits it."""

from __future__ import annotations

import re
import time
from datetime import timedelta
from html import unescape

import pytest
from auditlog.models import LogEntry
from django.contrib.auth.models import User
from django.core.management import call_command
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient

from accounts import tokens
from common.permissions import OPERATORS, VIEWERS
from common.tasks import prune_audit
from contracts import demand
from fleet import reconcile
from fleet.models import Node, Replica, Scale
from gateway.keys import create_key, hash_key

from .support.factories import add_node, add_served_model
from .support.roles import join

pytestmark = pytest.mark.django_db


def staff(username: str, group: str) -> User:
    return join(User.objects.create_user(username, password="a long password", is_staff=True), group)


def token_client(user: User) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Token " + tokens.issue(user))
    return client


def browser(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


def text_of(html: str) -> str:
    return " ".join(unescape(re.sub(r"<[^>]+>", " ", html)).split())


def entries_of(obj) -> list[LogEntry]:
    return list(LogEntry.objects.get_for_object(obj).order_by("timestamp", "id"))


@pytest.fixture
def viewer() -> User:
    return staff("vic", VIEWERS)


@pytest.fixture
def operator() -> User:
    return staff("olga", OPERATORS)


def test_a_limit_an_operator_raised_through_the_api_is_read_by_a_viewer_with_before_after_and_who(viewer, operator):
    key, _ = create_key("team-a", limits={"requests_per_minute": 60})

    raised = token_client(operator).patch(f"/api/gateway/keys/{key.pk}/", {"requests_per_minute": 120}, format="json")
    assert raised.status_code == 200, raised.content

    # Through the API: the viewer's own token, filtered to this key's changes.
    answer = token_client(viewer).get(f"/api/audit/?object_type=gateway.apikey&object_id={key.pk}&action=update")
    assert answer.status_code == 200, answer.content
    [entry] = answer.json()["results"]
    assert entry["changes"] == {"requests_per_minute": [60, 120]}
    assert entry["who"] == "olga"
    assert entry["remote_addr"] == "127.0.0.1"
    assert entry["object"] == "team-a" and entry["summary"] == "changed requests_per_minute"
    assert token_client(viewer).get("/api/audit/?who=olga").json()["count"] == 1

    # In the admin: the list, filtered to API keys, and the entry itself.
    pages = browser(viewer)
    listed = pages.get(
        "/admin/auditlog/logentry/?resource_type=" + str(LogEntry.objects.get(pk=entry["id"]).content_type_id)
    )
    assert listed.status_code == 200
    assert "changed requests_per_minute" in text_of(listed.content.decode()) and "olga" in text_of(
        listed.content.decode()
    )
    shown = pages.get(f"/admin/auditlog/logentry/{entry['id']}/change/")
    assert shown.status_code == 200
    words = text_of(shown.content.decode())
    assert "olga" in words and "127.0.0.1" in words
    assert re.search(r"requests per minute\s+60\s+120", words, re.I), words


def test_a_rotated_key_and_a_new_node_token_are_recorded_as_rotated_and_never_their_secret(operator):
    key, first_secret = create_key("ci")
    pages = browser(User.objects.create_superuser("root", password="a long password"))
    answer = pages.post(
        "/admin/gateway/apikey/", {"action": "make_new_secret", "_selected_action": [key.pk]}, follow=True
    )
    assert answer.status_code == 200
    key.refresh_from_db()
    second_secret = re.search(r"llmgw-[\w-]{40,}", answer.content.decode()).group(0)
    assert hash_key(second_secret) == key.key_hash

    rotation = entries_of(key)[-1]
    assert rotation.actor.username == "root"
    assert rotation.changes_dict["key_hash"] == ["(secret, not recorded)", "(secret, not recorded)"]
    body = token_client(operator).get(f"/api/audit/{rotation.pk}/").json()
    assert body["summary"].startswith("rotated the secret")

    call_command("node_token", "n7")
    node = Node.objects.get(name="n7")
    secrets = {first_secret, second_secret, hash_key(first_secret), key.key_hash, node.token_hash}
    for row in LogEntry.objects.all():
        written = f"{row.changes} {row.changes_text} {row.serialized_data} {row.additional_data} {row.object_repr}"
        assert not any(secret in written or secret[: len(secret) // 2] in written for secret in secrets)


def test_a_management_commands_change_is_recorded_as_the_command(operator):
    call_command("node_token", "n8", "--address", "10.0.0.8")
    create_key("batch")
    call_command("api_key", "revoke", "batch")

    node = Node.objects.get(name="n8")
    listed = token_client(operator).get("/api/audit/?who=command: node_token").json()["results"]
    assert [(e["object"], e["action"], e["who"], e["remote_addr"]) for e in reversed(listed)] == [
        ("n8", "create", "command: node_token", None),
        ("n8", "update", "command: node_token", None),
    ]
    assert listed[0]["changes"] == {
        "address": ["", "10.0.0.8"],
        "token_hash": ["", "(secret, not recorded)"],
    }

    [turned_off] = token_client(operator).get("/api/audit/?who=command: api_key").json()["results"]
    assert turned_off["changes"] == {"active": [True, False]}

    call_command("node_token", "n8", "--revoke")
    revoked = entries_of(node)[-1]
    assert revoked.changes_dict == {"token_hash": ["(secret, not recorded)", ""]}
    assert revoked.additional_data == {"by": "command: node_token"}


def test_nobody_can_change_or_delete_an_entry_through_the_api_or_the_admin(operator):
    root = User.objects.create_superuser("root", password="a long password")
    Node.objects.create(name="n1")
    entry = LogEntry.objects.get()
    api = token_client(root)
    assert api.post("/api/audit/", {"action": "create"}, format="json").status_code == 405
    assert api.patch(f"/api/audit/{entry.pk}/", {"object": "x"}, format="json").status_code == 405
    assert api.delete(f"/api/audit/{entry.pk}/").status_code == 405

    pages = browser(root)
    shown = pages.get(f"/admin/auditlog/logentry/{entry.pk}/change/").content.decode()
    assert 'name="_save"' not in shown
    assert pages.post(f"/admin/auditlog/logentry/{entry.pk}/change/", {"object_repr": "x"}).status_code == 403
    assert pages.get(f"/admin/auditlog/logentry/{entry.pk}/delete/").status_code == 403
    assert pages.post(
        "/admin/auditlog/logentry/", {"action": "delete_selected", "_selected_action": [entry.pk], "post": "yes"}
    ).status_code in (200, 302)
    assert LogEntry.objects.filter(pk=entry.pk, object_repr="n1").exists()

    # Staff who may read nothing of it are refused with the sentence.
    stranger = User.objects.create_user("sam", is_staff=True)
    refused = token_client(stranger).get("/api/audit/")
    assert refused.status_code == 403 and "auditlog.view_logentry" in refused.json()["detail"]


def test_entries_older_than_llmgw_audit_days_are_deleted_by_the_daily_task(settings):
    settings.AUDIT_DAYS = 30
    Node.objects.create(name="old")
    Node.objects.create(name="new")
    LogEntry.objects.filter(object_repr="old").update(timestamp=timezone.now() - timedelta(days=31))

    assert prune_audit() == 1
    assert list(LogEntry.objects.values_list("object_repr", flat=True)) == ["new"]


@pytest.mark.django_db(transaction=True)
def test_the_autoscalers_new_count_is_recorded_as_the_system_with_before_and_after(redis_client, operator):
    add_node("a")
    add_served_model("m", scaling_min=1, scaling_max=5, target_load=2)
    reconcile.reconcile()
    for replica in Replica.objects.filter(node__isnull=False):
        replica.enter("ready", endpoint=f"http://127.0.0.1:1/{replica.pk}/v1")
        replica.save()
    redis_client.hset(
        demand.LOAD_KEY,
        "g1",
        demand.encode(
            {
                "at": time.time(),
                "models": {"m": {"in_flight": 5, "waiting": 0, "last_request": time.time()}},
                "replicas": {},
            }
        ),
    )
    reconcile.reconcile()  # what the beat's fleet.reconcile runs, with no person behind it
    assert Scale.objects.get(model_name="m").replicas == 3

    [entry] = token_client(operator).get("/api/audit/?object_type=fleet.scale&who=system").json()["results"]
    assert entry["changes"]["replicas"] == [1, 3] and entry["who"] == "system" and entry["remote_addr"] is None
