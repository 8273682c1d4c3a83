"""Staff in the groups of docs/roles.md, as a test wants them."""

from __future__ import annotations

from importlib import import_module

from django.apps import apps
from django.contrib.auth.models import Group

from common.permissions import OPERATORS, VIEWERS


def groups() -> dict[str, Group]:
    """The two groups, made again by their migration's own code when an earlier test's flush emptied the tables."""
    if Group.objects.filter(name__in=[VIEWERS, OPERATORS]).count() != 2:
        import_module("common.migrations.0001_staff_groups").make_groups(apps)
        import_module("common.migrations.0002_audit_log_readers").let_groups_read(apps)
        import_module("common.migrations.0003_team_permissions").give_team_permissions(apps)
    return {group.name: group for group in Group.objects.filter(name__in=[VIEWERS, OPERATORS])}


def join(user, name: str = VIEWERS):
    """`user` in the group `name` ("llmgw viewers" unless said), returned for chaining."""
    user.groups.add(groups()[name])
    return user
