"""What the gateway's database role may do: exactly what `manage.py gateway` reads and writes, and nothing more.

A gateway host parses every client's input, so it is the one most likely to be taken
over. Its role reads its routing table and writes usage; it cannot read staff's API
tokens, users' passwords and addresses, sessions, a node's token hash (which signs that node's orders) or a
pull's pass key. Where a table holds a secret, SELECT is granted column by column.
`manage.py gateway_grants ROLE` prints (or, with --apply, runs) these statements;
docs/fleet.md and tests/test_gateway_role.py use them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from django.contrib.auth import get_user_model
from django.db import models

from accounts.models import Team, TeamMember
from catalog.models import Model, Profile
from fleet.models import Node, Replica

from .models import ApiKey, TableChange, Usage, UsageBatch


@dataclass(frozen=True)
class Grant:
    model: type[models.Model]
    why: str
    # None: every column (the table holds no secret); else only these fields' columns.
    select: tuple[str, ...] | None = None
    insert: bool = False
    update: tuple[str, ...] | bool = False  # True: every column; a tuple: only these fields'
    delete: bool = False

    @property
    def table(self) -> str:
        return self.model._meta.db_table

    def columns(self, fields: tuple[str, ...]) -> str:
        return ", ".join(f'"{self.model._meta.get_field(name).column}"' for name in fields)


GRANTS = (
    Grant(Model, "its routes: names, aliases, limits, kinds; and whether one can be woken (scaling)"),
    Grant(Profile, "the profiles' weights"),
    Grant(Replica, "the ready replicas' endpoints; why a model has none ready"),
    Grant(
        Node,
        "the key of its engines' secrets, and whether it is heard from; never token_hash, which signs its orders",
        select=("id", "name", "last_heartbeat", "replica_key"),
    ),
    Grant(ApiKey, "the keys' hashes, models and limits; when a key was last used", update=("last_used",)),
    Grant(Team, "the teams' models and budgets, which their keys count against"),
    Grant(TeamMember, "who is in which team: a key whose owner left its team is refused"),
    Grant(
        get_user_model(),
        "whether a key's owner may still use llmgw; never a password, a name or an address",
        select=("id", "is_active"),
    ),
    Grant(TableChange, "the change log it re-reads by; it prunes marks older than ten minutes", delete=True),
    Grant(Usage, "usage, added per key, model and day", insert=True, update=True),
    Grant(UsageBatch, "the usage batches already written, so none is added twice", insert=True, delete=True),
)

ROLE_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")


def role_problem(role: str) -> str | None:
    if not ROLE_NAME.fullmatch(role):
        return f"{role!r} is not a role name this command writes grants for: lower-case letters, digits and _"
    return None


def statements(role: str) -> list[str]:
    """The role's privileges, all of them: what it had before is revoked first, so running them again is safe."""
    if problem := role_problem(role):
        raise ValueError(problem)
    said = [
        f"REVOKE ALL ON ALL TABLES IN SCHEMA public FROM {role}",
        f"REVOKE ALL ON ALL SEQUENCES IN SCHEMA public FROM {role}",
        f"GRANT USAGE ON SCHEMA public TO {role}",
    ]
    for grant in GRANTS:
        table = f'"{grant.table}"'
        select = "SELECT" if grant.select is None else f"SELECT ({grant.columns(grant.select)})"
        said.append(f"GRANT {select} ON {table} TO {role}")
        if grant.insert:
            said.append(f"GRANT INSERT ON {table} TO {role}")
        if grant.update is True:
            said.append(f"GRANT UPDATE ON {table} TO {role}")
        elif grant.update:
            said.append(f"GRANT UPDATE ({grant.columns(grant.update)}) ON {table} TO {role}")
        if grant.delete:
            said.append(f"GRANT DELETE ON {table} TO {role}")
    return said
