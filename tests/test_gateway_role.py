"""The gateway's database role holds exactly what the gateway reads and writes (gateway/grants.py).

A gateway host parses every client's input: taken over, it has its database role.
docs/fleet.md used to grant that role SELECT on every table, so it read staff's API
tokens, users' password hashes, sessions, pull pass keys and each node's token hash
(which signs every order for that node). Here the real gateway process runs as a role
made by `manage.py gateway_grants --apply` on the tests' real PostgreSQL, serves, and
the same role is refused every one of those reads.
"""

from __future__ import annotations

import io

import psycopg
import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from django.db import connection

from accounts import tokens
from contracts import credentials, signing
from fleet.enrolment import issue_token
from gateway import grants
from gateway.keys import create_key
from gateway.models import ApiKey, Usage
from mirror.models import MirrorPull

from .support import processes
from .support.factories import add_model, add_replica
from .support.gateway import chat, client, error_of, until_routed
from .support.gateway_process import start_gateway
from .support.waiting import wait_until

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(connection.vendor != "postgresql", reason="roles and grants are PostgreSQL's"),
]

ROLE = "llmgw_gateway_test"

# What a gateway taken over must not read: (what it is, a query that would read it).
FORBIDDEN_READS = [
    ("staff's API tokens", "SELECT key_hash FROM accounts_apitoken"),
    ("users and their password hashes", "SELECT username, password FROM auth_user"),
    ("staff's sessions", "SELECT session_key, session_data FROM django_session"),
    ("a node's token hash, which signs its orders", "SELECT token_hash FROM fleet_node"),
    ("a node's whole row", "SELECT * FROM fleet_node"),
    ("a pull's pass key", "SELECT pass_key FROM mirror_mirrorpull"),
]
FORBIDDEN_WRITES = [
    ("a replica's endpoint", "UPDATE fleet_replica SET endpoint = 'http://elsewhere/v1'"),
    ("a key's hash", "UPDATE gateway_apikey SET key_hash = 'x'"),
    ("a key's limits", "UPDATE gateway_apikey SET requests_per_minute = NULL"),
    ("a new node", "INSERT INTO fleet_node (name) VALUES ('mine')"),
    ("a catalog model", "DELETE FROM catalog_model"),
]


@pytest.fixture
def gateway_role():
    """A login role with exactly the gateway's grants, and the DATABASE_URL that signs in as it."""
    with connection.cursor() as cursor:
        cursor.execute(f"CREATE ROLE {ROLE} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE")
    try:
        call_command("gateway_grants", ROLE, "--apply", stdout=io.StringIO())
        db = settings.DATABASES["default"]  # the tests' PostgreSQL lets any role in without a password
        yield f"postgres://{ROLE}@{db['HOST']}:{db['PORT']}/{db['NAME']}"
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"DROP OWNED BY {ROLE}")
            cursor.execute(f"DROP ROLE {ROLE}")


def as_role(url: str) -> psycopg.Connection:
    return psycopg.connect(url.replace("postgres://", "postgresql://"), autocommit=True)


def test_the_real_gateway_serves_and_writes_usage_as_a_role_with_only_its_grants(tmp_path, replicas, gateway_role):
    process, url = start_gateway(tmp_path, LLMGW_HOLD_S=1, DATABASE_URL=gateway_role)
    try:
        token = issue_token("n1")
        add_model()
        engine = replicas()
        replica = add_replica("chat", engine.base)
        add_model("placing")
        add_replica("placing", "", state="pending", reason="no node has 64 GB of memory free")
        _, secret = create_key("client")
        session = client(secret)
        until_routed(session, url)

        answer = chat(session, url)
        assert answer.status_code == 200, answer.text
        assert chat(session, url, stream=True).status_code == 200
        # The engine was shown the secret its node derives from its token, made without reading token_hash.
        nonce = credentials.replica_nonce(replica.created)
        expected = credentials.replica_secret(signing.token_hash(token), replica.pk, nonce)
        assert expected
        assert {h["Authorization"] for h in engine.headers} == {f"Bearer {expected}"}

        # Why a model has no replica: read from the replicas and their nodes' heartbeats.
        pending = chat(session, url, model="placing")
        assert pending.status_code == 503 and "is pending: no node has 64 GB" in error_of(pending)["message"]

        # Usage and the key's last use are written.
        def counted():
            return Usage.objects.filter(key__name="client", model_name="chat", requests=2).first()

        wait_until(counted, timeout=10, what="the usage to be written by the gateway's role")
        assert ApiKey.objects.get(name="client").last_used is not None
        # A key turned off reaches the gateway through the change log it reads.
        ApiKey.objects.filter(name="client").update(active=False)
        wait_until(lambda: chat(session, url).status_code == 401, timeout=10, what="the turned-off key refused")
        assert "permission denied" not in process.output()
    finally:
        process.stop()


@pytest.mark.parametrize("what, query", FORBIDDEN_READS, ids=[w for w, _ in FORBIDDEN_READS])
def test_the_gateways_role_cannot_read_a_secret(gateway_role, what, query):
    user = get_user_model().objects.create_user("ops", password="a long password", is_staff=True)
    tokens.issue(user)
    issue_token("n1")
    MirrorPull.objects.create(url="https://other.example/m/v1/", model="m", version="v1", pass_key="p" * 64)
    with as_role(gateway_role) as role, pytest.raises(psycopg.errors.InsufficientPrivilege, match="permission denied"):
        role.execute(query)


@pytest.mark.parametrize("what, statement", FORBIDDEN_WRITES, ids=[w for w, _ in FORBIDDEN_WRITES])
def test_the_gateways_role_cannot_change_what_it_only_reads(gateway_role, what, statement):
    with as_role(gateway_role) as role, pytest.raises(psycopg.errors.InsufficientPrivilege, match="permission denied"):
        role.execute(statement)


PRIVILEGES = ("SELECT", "INSERT", "UPDATE", "DELETE", "TRUNCATE", "REFERENCES", "TRIGGER")


def granted(grant: grants.Grant | None, privilege: str, column: str | None = None) -> bool:
    """What gateway/grants.py says the role has on a table (column None) or one of its columns."""
    if grant is None:
        return False
    columns = {
        "SELECT": grant.select,
        "UPDATE": grant.update if isinstance(grant.update, tuple) else None,
    }.get(privilege)
    whole = {"SELECT": grant.select is None, "INSERT": grant.insert, "UPDATE": grant.update is True}
    whole["DELETE"] = grant.delete
    if whole.get(privilege, False):
        return True
    if column is None or not columns:
        return False
    return column in {grant.model._meta.get_field(name).column for name in columns}


def test_the_roles_privileges_read_back_from_postgresql_are_exactly_the_list(gateway_role):
    by_table = {grant.table: grant for grant in grants.GRANTS}
    differ = []
    with connection.cursor() as cursor:
        for table in connection.introspection.table_names():
            grant = by_table.get(table)
            for privilege in PRIVILEGES:
                cursor.execute("SELECT has_table_privilege(%s, %s, %s)", [ROLE, table, privilege])
                if cursor.fetchone()[0] != granted(grant, privilege):
                    differ.append(f"{privilege} on {table}")
            for column in [c.name for c in connection.introspection.get_table_description(cursor, table)]:
                for privilege in ("SELECT", "INSERT", "UPDATE", "REFERENCES"):
                    cursor.execute("SELECT has_column_privilege(%s, %s, %s, %s)", [ROLE, table, column, privilege])
                    if cursor.fetchone()[0] != granted(grant, privilege, column):
                        differ.append(f"{privilege} on {table}.{column}")
    assert differ == []
    assert "fleet_node" in by_table and not granted(by_table["fleet_node"], "SELECT", "token_hash")


def test_gateway_grants_refuses_a_role_name_it_would_have_to_quote():
    with pytest.raises(CommandError, match="is not a role name"):
        call_command("gateway_grants", "gw; DROP TABLE auth_user")


def test_docs_fleet_shows_the_statements_the_command_prints(capsys):
    call_command("gateway_grants", "llmgw_gateway")
    printed = capsys.readouterr().out.strip()
    assert printed in (processes.BASE_DIR / "docs" / "fleet.md").read_text()
