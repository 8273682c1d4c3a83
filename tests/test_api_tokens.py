"""Staff's API tokens: stored only as hashes, good for LLMGW_API_TOKEN_DAYS, shown once.

DRF's rest_framework.authtoken kept every token in plain in `authtoken_token`, for ever:
anyone who could read the table (a backup, the gateway's database role) signed in as
staff. Here the real admin server (pytest-django's live server) is asked over HTTP.
"""

from __future__ import annotations

import io
from datetime import timedelta

import pytest
import requests
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.utils import timezone

from accounts import tokens
from accounts.models import ApiToken

from .support.roles import join

pytestmark = pytest.mark.django_db(transaction=True)

LISTING = "/api/mirror/versions/"


def staff(username: str = "ops"):
    """A staff member who may read the mirror (docs/roles.md): what a token opens is their permissions."""
    return join(get_user_model().objects.create_user(username, password="a long password", is_staff=True))


def ask(live_server, key: str) -> requests.Response:
    return requests.get(live_server.url + LISTING, headers={"Authorization": f"Token {key}"}, timeout=30)


def every_value_in_the_database() -> str:
    """Every row of every table, as text: what a copy of the database gives away."""
    said = []
    with connection.cursor() as cursor:
        for table in connection.introspection.table_names():
            cursor.execute(f'SELECT * FROM "{table}"')
            said.extend(repr(row) for row in cursor.fetchall())
    return "\n".join(said)


def test_a_token_from_api_token_works_and_the_database_holds_only_its_hash(live_server):
    staff("ops")
    out = io.StringIO()
    call_command("api_token", "ops", stdout=out)
    key = out.getvalue().strip()
    answer = ask(live_server, key)
    assert answer.status_code == 200, answer.text
    assert key not in every_value_in_the_database()
    (token,) = ApiToken.objects.all()
    assert token.key_hash == tokens.key_hash(key) and token.last_used is not None
    # Shown once: asked again, the command makes another token, and the first still works.
    again = io.StringIO()
    call_command("api_token", "ops", stdout=again)
    assert again.getvalue().strip() != key
    assert ask(live_server, key).status_code == 200 and ask(live_server, again.getvalue().strip()).status_code == 200


def test_an_expired_token_gets_401_with_a_sentence_saying_when_and_how_to_get_another(live_server, settings):
    settings.API_TOKEN_DAYS = 2
    user = staff("ops")
    key = tokens.issue(user)
    token = ApiToken.objects.get(user=user)
    assert timedelta(days=2) - timedelta(minutes=1) < token.expires - timezone.now() <= timedelta(days=2)
    ApiToken.objects.filter(pk=token.pk).update(expires=timezone.now() - timedelta(seconds=1))
    answer = ask(live_server, key)
    assert answer.status_code == 401
    detail = answer.json()["detail"]
    assert "The API token expired at" in detail and "manage.py api_token ops" in detail
    assert answer.headers["WWW-Authenticate"] == "Token"


def test_a_wrong_token_and_a_malformed_header_are_refused_with_a_sentence(live_server):
    tokens.issue(staff("ops"))
    assert "not one llmgw knows" in ask(live_server, "0" * 40).json()["detail"]
    answer = requests.get(live_server.url + LISTING, headers={"Authorization": "Token a b"}, timeout=30)
    assert answer.status_code == 401 and "one key, no spaces" in answer.json()["detail"]


def test_a_token_whose_user_left_staff_or_was_deactivated_opens_nothing(live_server):
    user = staff("ops")
    key = tokens.issue(user)
    user.is_staff = False
    user.save()
    assert ask(live_server, key).status_code == 403
    user.is_active = False
    user.save()
    assert "no longer active" in ask(live_server, key).json()["detail"]


def test_drf_tokens_made_before_are_hashed_by_the_migration_and_keep_working_until_their_expiry(live_server, settings):
    """A database upgraded from rest_framework.authtoken: its table is read, hashed and dropped."""
    user = staff("robot")
    old_key = "9944b09199c62bcf9418ad846dd0e4bbdfc6ee4b"  # DRF's shape: 40 hex characters
    executor = MigrationExecutor(connection)
    executor.migrate([("accounts", "0001_api_token")])
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE TABLE authtoken_token (key varchar(40) PRIMARY KEY, created timestamp with time zone NOT NULL, "
            "user_id integer NOT NULL UNIQUE)"
        )
        cursor.execute("INSERT INTO authtoken_token VALUES (%s, %s, %s)", [old_key, timezone.now(), user.pk])
    assert ask(live_server, old_key).status_code == 401  # not yet migrated: the plain table is never read

    executor.loader.build_graph()
    executor.migrate(executor.loader.graph.leaf_nodes())
    assert "authtoken_token" not in connection.introspection.table_names()
    answer = ask(live_server, old_key)
    assert answer.status_code == 200, answer.text
    assert old_key not in every_value_in_the_database()
    token = ApiToken.objects.get(user=user)
    assert token.expires - timezone.now() > timedelta(days=settings.API_TOKEN_DAYS - 1)
