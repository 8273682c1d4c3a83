"""Who sees what of teams, keys and usage: the one place /me/ and the API ask.

A person sees their own keys and their own usage, and the members of their teams; a team admin
also sees the team's keys and usage and changes its members. Staff with a model's view
permission see every row of it. A row someone may not see is not found (404), never refused
(403): a guessed id tells an attacker nothing about whether it exists.
"""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.db.models import Q, QuerySet

from accounts.models import Team, TeamMember
from gateway.models import ApiKey, Usage

ADMIN = TeamMember.Role.ADMIN


def teams_of(user) -> QuerySet[Team]:
    return Team.objects.filter(members__user=user).distinct()


def admin_teams_of(user) -> QuerySet[Team]:
    return Team.objects.filter(members__user=user, members__role=ADMIN).distinct()


def is_team_admin(user, team: Team) -> bool:
    return TeamMember.objects.filter(user=user, team=team, role=ADMIN).exists()


def teams(user) -> QuerySet[Team]:
    if user.has_perm("accounts.view_team"):
        return Team.objects.all()
    return teams_of(user)


def members(user) -> QuerySet[TeamMember]:
    """The members of the teams this user is in (everyone's, for staff who may view them)."""
    rows = TeamMember.objects.select_related("team", "user")
    if user.has_perm("accounts.view_teammember"):
        return rows
    return rows.filter(team__in=teams_of(user))


def keys(user) -> QuerySet[ApiKey]:
    """Their own keys, and their admin teams' keys."""
    rows = ApiKey.objects.select_related("team", "owner")
    if user.has_perm("gateway.view_apikey"):
        return rows
    return rows.filter(Q(owner=user) | Q(team__in=admin_teams_of(user)))


def usage(user) -> QuerySet[Usage]:
    """The usage of the keys this user may see."""
    rows = Usage.objects.select_related("key", "key__team", "key__owner")
    if user.has_perm("gateway.view_usage"):
        return rows
    return rows.filter(Q(key__owner=user) | Q(key__team__in=admin_teams_of(user)))


def may_manage_members(user, team: Team) -> bool:
    return user.has_perm("accounts.change_team") or is_team_admin(user, team)


def find_user(who: str):
    """A user by username, or by email when exactly one account has it; None otherwise."""
    who = who.strip()
    users = get_user_model().objects.filter(is_active=True)
    found = users.filter(username=who).first()
    if found is None and "@" in who:
        by_email = list(users.filter(email__iexact=who)[:2])
        found = by_email[0] if len(by_email) == 1 else None
    return found
