"""The gateway's database role can run every query the gateway's code makes, on the schema after all migrations
(issue 41 item 8).

tests/test_gateway_role.py holds the role to its list; this holds the list to the code.
The gateway's own code (its table reader, whole and by changes, and its usage recorder)
runs here on Django's connection signed in as a role made by `gateway_grants --apply`,
with a key owned by a user in a team so that every table it reads is read. A migration
that adds a table the gateway reads fails here, naming the table, until gateway/grants.py
grants it.
"""

from __future__ import annotations

import contextlib
import io
import re

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.db import connection
from django.test.utils import CaptureQueriesContext

from accounts.models import Team, TeamMember
from catalog.models import Model
from gateway import grants
from gateway.keys import create_key
from gateway.models import ApiKey, Usage
from gateway.routes import TableReader
from gateway.usage import Recorder

from .support.factories import add_model, add_replica

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(connection.vendor != "postgresql", reason="roles and grants are PostgreSQL's"),
]

ROLE = "llmgw_gateway_queries"
TABLE = re.compile(r'\b(?:FROM|JOIN|INTO|UPDATE)\s+"([a-z0-9_]+)"', re.IGNORECASE)


@pytest.fixture
def gateway_role():
    with connection.cursor() as cursor:
        cursor.execute(f"CREATE ROLE {ROLE} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE")
    try:
        call_command("gateway_grants", ROLE, "--apply", stdout=io.StringIO())
        yield ROLE
    finally:
        connection.close()
        with connection.cursor() as cursor:
            cursor.execute(f"DROP OWNED BY {ROLE}")
            cursor.execute(f"DROP ROLE {ROLE}")


@contextlib.contextmanager
def signed_in_as(role: str):
    """Django's connection as `role` (the tests' PostgreSQL lets any role in without a password)."""
    saved = dict(connection.settings_dict)
    connection.close()
    connection.settings_dict.update(USER=role, PASSWORD="")
    try:
        yield
    finally:
        connection.close()
        connection.settings_dict.clear()
        connection.settings_dict.update(saved)


def test_the_gateway_role_runs_every_query_of_the_gateways_code_and_each_table_it_touches_is_granted(
    gateway_role, tmp_path
):
    add_model("chat")
    add_replica("chat", "http://127.0.0.1:9/v1")
    owner = get_user_model().objects.create_user("owner")
    team = Team.objects.create(name="red", model_names=["chat"])
    TeamMember.objects.create(team=team, user=owner)
    key, _ = create_key("k")
    ApiKey.objects.filter(pk=key.pk).update(team=team, owner=owner)
    recorder = Recorder(tmp_path / "spool")

    reader = TableReader()
    with signed_in_as(gateway_role), CaptureQueriesContext(connection) as whole:
        assert connection.cursor().connection.info.user == gateway_role
        table = reader.read()
        assert "chat" in table.routes and table.keys
    Model.objects.filter(name="chat").update(description="changed")  # as staff do: a change mark for the reader
    with signed_in_as(gateway_role), CaptureQueriesContext(connection) as changes:
        reader.read()
        recorder.add(key.pk, "chat", 3, 4)
        recorder.flush()
        assert recorder.pending() == 0, "usage stayed in the spool: the role could not write it (the log says why)"
    assert reader.full_reads == 1, "the second read was to be by changes"

    assert Usage.objects.filter(key=key).exists()
    queries = whole.captured_queries + changes.captured_queries
    touched = {name for query in queries for name in TABLE.findall(query["sql"])}
    granted = {grant.table for grant in grants.GRANTS}
    assert touched - granted == set(), f"the gateway's code touches tables its role is not granted: {touched - granted}"
    assert {"gateway_apikey", "gateway_usage", "catalog_model", "fleet_replica"} <= touched
