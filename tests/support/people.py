"""Two teams, their people, keys and usage: what the tests of /me/ and of its API attack."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date
from decimal import Decimal

from django.contrib.auth import get_user_model

from accounts.models import Team, TeamMember
from gateway.keys import give_secret
from gateway.models import ApiKey, Usage

PASSWORD = "a long enough password"


@dataclass
class Org:
    red: Team
    blue: Team
    alice: object  # red, member
    arthur: object  # red, team admin
    bob: object  # blue, member
    alice_key: ApiKey
    arthur_key: ApiKey
    bob_key: ApiKey


def person(username: str, email: str = "", password: str | None = None, **fields):
    """A user; with no password (the tests sign most in with force_login): hashing one costs a second under load."""
    return get_user_model().objects.create_user(username, email or f"{username}@example.org", password, **fields)


def key_of(owner, team: Team, name: str, models: list[str] | None = None) -> ApiKey:
    key = ApiKey(name=name, owner=owner, team=team, model_names=models or [])
    give_secret(key)
    key.save()
    return key


def used(key: ApiKey, model: str, day: date, tokens: int, spend: str = "0") -> Usage:
    return Usage.objects.create(
        key=key,
        model_name=model,
        day=day,
        requests=1,
        prompt_tokens=tokens // 2,
        completion_tokens=tokens - tokens // 2,
        spend=Decimal(spend),
    )


def two_teams() -> Org:
    red = Team.objects.create(name="red", model_names=["chat", "embed"], tokens_per_day=1000)
    blue = Team.objects.create(name="blue")
    alice, arthur, bob = person("alice", password=PASSWORD), person("arthur"), person("bob")
    TeamMember.objects.create(team=red, user=alice)
    TeamMember.objects.create(team=red, user=arthur, role=TeamMember.Role.ADMIN)
    TeamMember.objects.create(team=blue, user=bob)
    return Org(
        red=red,
        blue=blue,
        alice=alice,
        arthur=arthur,
        bob=bob,
        alice_key=key_of(alice, red, "alice-laptop"),
        arthur_key=key_of(arthur, red, "arthur-notebook"),
        bob_key=key_of(bob, blue, "bob-secret-project"),
    )
