"""The team's members in the admin, as an operator manages them: by username, without reading the accounts."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.test import Client
from django.urls import reverse

from accounts.models import Team, TeamMember
from common.permissions import OPERATORS

from .support.roles import groups

pytestmark = pytest.mark.django_db


@pytest.fixture
def operator() -> Client:
    groups()
    otto = get_user_model().objects.create_user("otto", is_staff=True)
    otto.groups.add(Group.objects.get(name=OPERATORS))
    client = Client()
    client.force_login(otto)
    return client


def _members_form(team: Team, rows: list[tuple[str, str, int | None]]) -> dict:
    """The team's change form as posted, with the members inline: (username, role, existing member's id)."""
    data = {"name": team.name, "model_names": "[]", "members-TOTAL_FORMS": str(len(rows))}
    data["members-INITIAL_FORMS"] = str(sum(1 for *_, pk in rows if pk))
    data["members-MIN_NUM_FORMS"], data["members-MAX_NUM_FORMS"] = "0", "1000"
    for n, (username, role, pk) in enumerate(rows):
        data[f"members-{n}-user"] = username
        data[f"members-{n}-role"] = role
        data[f"members-{n}-team"] = str(team.pk)
        if pk:
            data[f"members-{n}-id"] = str(pk)
    return data


def test_an_operator_adds_a_member_by_username_and_sees_the_members_by_name(operator):
    team = Team.objects.create(name="red")
    alice = get_user_model().objects.create_user("alice")
    bob = get_user_model().objects.create_user("bob")
    kept = TeamMember.objects.create(team=team, user=bob)
    page = reverse("admin:accounts_team_change", args=[team.pk])

    shown = operator.get(page)
    assert shown.status_code == 200
    assert 'value="bob"' in shown.content.decode(), "an existing member is shown by username, not by id"
    assert not operator.get(reverse("admin:auth_user_changelist")).status_code == 200, "operators read no accounts"

    answer = operator.post(page, _members_form(team, [("bob", "member", kept.pk), ("alice", "admin", None)]))

    assert answer.status_code == 302, answer.content.decode()[:2000]
    assert {(m.user.username, m.role) for m in team.members.all()} == {("bob", "member"), ("alice", "admin")}
    assert team.members.get(user=alice).role == TeamMember.Role.ADMIN


def test_an_unknown_username_is_a_sentence_and_the_team_is_left_as_it_was(operator):
    team = Team.objects.create(name="red")
    bob = get_user_model().objects.create_user("bob")
    kept = TeamMember.objects.create(team=team, user=bob)
    page = reverse("admin:accounts_team_change", args=[team.pk])

    answer = operator.post(page, _members_form(team, [("bob", "member", kept.pk), ("alicia", "member", None)]))

    assert answer.status_code == 200
    said = answer.content.decode()
    assert "No one has the username alicia: a person signs in to llmgw once" in said
    assert list(team.members.values_list("user__username", flat=True)) == ["bob"]
