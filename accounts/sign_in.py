"""What the identity provider's claims make of a person in llmgw, at every sign-in (docs/sign-in.md).

The provider decides, for the people it signs in: whether they are staff (and in which of the
two staff groups), and which teams they are in with which role. It decides only what it made:
a membership made by hand (`from_provider=False`) is never changed or removed by it, and a
local account is never matched by name or address.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.db import transaction
from django.utils import timezone

from .models import ProviderAccount, Team, TeamMember

log = logging.getLogger(__name__)

# The staff groups' names, as common/permissions.py has them (accounts sits below common):
# tests/test_oidc_sign_in.py keeps the two in step.
VIEWERS = "llmgw viewers"
OPERATORS = "llmgw operators"

MEMBER, ADMIN = TeamMember.Role.MEMBER, TeamMember.Role.ADMIN


@dataclass(frozen=True)
class Mapping:
    """How group names become roles: LLMGW_OIDC_* settings, as a value a pure function can take."""

    staff_groups: frozenset[str]
    operator_groups: frozenset[str]
    team_prefix: str
    team_admin_suffix: str

    @classmethod
    def from_settings(cls) -> Mapping:
        return cls(
            staff_groups=settings.OIDC_STAFF_GROUPS,
            operator_groups=settings.OIDC_OPERATOR_GROUPS,
            team_prefix=settings.OIDC_TEAM_PREFIX,
            team_admin_suffix=settings.OIDC_TEAM_ADMIN_SUFFIX,
        )


def groups_of(claims: dict, claim: str) -> frozenset[str]:
    """The group names in the claim: a list of names (one name alone is taken as a list of one); anything else is none."""
    value = claims.get(claim)
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        if value is not None:
            log.warning(
                "the provider's %r claim is a %s, not a list of group names: taken as no groups",
                claim,
                type(value).__name__,
            )
        return frozenset()
    return frozenset(name for name in value if isinstance(name, str))


def team_roles(groups: frozenset[str], mapping: Mapping) -> dict[str, str]:
    """{team name: role} the groups name: PREFIX+NAME makes a member of NAME, PREFIX+NAME+SUFFIX its admin.

    Names only: whether such a team exists is the caller's question.
    """
    roles: dict[str, str] = {}
    suffix = mapping.team_admin_suffix
    for group in groups:
        if not group.startswith(mapping.team_prefix):
            continue
        name = group[len(mapping.team_prefix) :]
        if suffix and name.endswith(suffix) and len(name) > len(suffix):
            roles[name[: -len(suffix)]] = ADMIN
        if name and name not in roles:
            roles[name] = MEMBER
    return roles


def staff_roles(groups: frozenset[str], mapping: Mapping) -> tuple[bool, bool]:
    """(a viewer, an operator): either makes the person staff."""
    return bool(groups & mapping.staff_groups), bool(groups & mapping.operator_groups)


def username_for(claims: dict) -> str:
    """A username nobody has: the provider's preferred name, else the email, else the subject; -2, -3... if taken.

    Taken by a local account or another person: a name is never how a person is found again.
    """
    wanted = (claims.get("preferred_username") or claims.get("email") or claims["sub"])[:140]
    User = get_user_model()
    name, n = wanted, 1
    while User.objects.filter(username=name).exists():
        n += 1
        name = f"{wanted}-{n}"
    return name


def find_user(issuer: str, claims: dict):
    """The user this subject of this provider signed in as before, or None."""
    account = ProviderAccount.objects.filter(issuer=issuer, subject=claims["sub"]).select_related("user").first()
    return account.user if account else None


@transaction.atomic
def make_user(issuer: str, claims: dict):
    user = get_user_model().objects.create_user(username_for(claims), email=claims.get("email") or "")
    ProviderAccount.objects.create(user=user, issuer=issuer, subject=claims["sub"])
    return user


@transaction.atomic
def apply_claims(user, claims: dict, groups_claim: str, mapping: Mapping):
    """The person as the provider says they are now: name, email, staff groups, teams. Returns the user."""
    groups = groups_of(claims, groups_claim)
    viewer, operator = staff_roles(groups, mapping)
    user.email = (claims.get("email") or user.email)[:254]
    user.first_name = (claims.get("given_name") or user.first_name)[:150]
    user.last_name = (claims.get("family_name") or user.last_name)[:150]
    user.is_staff = viewer or operator
    user.save(update_fields=["email", "first_name", "last_name", "is_staff"])
    for name, wanted in ((VIEWERS, viewer), (OPERATORS, operator)):
        group = Group.objects.filter(name=name).first()
        if group is None:
            log.warning(
                "the staff group %r is missing (its migration, common 0001, makes it): %s is not put in it", name, user
            )
        elif wanted:
            user.groups.add(group)
        else:
            user.groups.remove(group)
    _apply_teams(user, team_roles(groups, mapping))
    ProviderAccount.objects.filter(user=user).update(last_sign_in=timezone.now())
    return user


def _apply_teams(user, roles: dict[str, str]) -> None:
    """Memberships from the provider follow its groups; those made by hand stay as they are.

    A group naming a team llmgw does not have makes none: staff make a team, with its budgets,
    before the provider may fill it (a team made from a group would have no budget at all).
    """
    teams = {team.name: team for team in Team.objects.filter(name__in=roles)}
    for name in sorted(set(roles) - set(teams)):
        log.info("%s is in the provider's group for team %r, which llmgw does not have: no membership made", user, name)
    wanted = {team.pk: roles[name] for name, team in teams.items()}
    held = {m.team_id: m for m in TeamMember.objects.filter(user=user)}
    for team_id, membership in held.items():
        if not membership.from_provider:
            continue
        if team_id not in wanted:
            membership.delete()
        elif membership.role != wanted[team_id]:
            membership.role = wanted[team_id]
            membership.save(update_fields=["role"])
    TeamMember.objects.bulk_create(
        TeamMember(team_id=team_id, user=user, role=role, from_provider=True)
        for team_id, role in wanted.items()
        if team_id not in held
    )
