"""What people do on /me/ and through the API: make and revoke their keys, change their team's members.

Each function checks who may do it (people/access.py) and raises Problem with the sentence
the person reads; a row they may not see is NotFound, the same answer as a row that is not there.
"""

from __future__ import annotations

from datetime import datetime

from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.utils import timezone

from accounts.models import Team, TeamMember
from gateway.keys import describe_problem, give_secret
from gateway.models import ApiKey

from . import access


class Problem(ValueError):
    """What someone asked cannot be done; the message says why, in a sentence."""


class NotFound(LookupError):
    """The row is not there, or not theirs to see."""


def make_key(
    user, name: str, team_id, models: list[str] | None = None, expires: datetime | None = None
) -> tuple[ApiKey, str]:
    """A key of `user`'s for one of their teams: the record, and the secret shown once."""
    team = access.teams_of(user).filter(pk=_number(team_id)).first()
    if team is None:
        raise Problem("Choose one of your own teams for the key.")
    name = (name or "").strip()
    if not name:
        raise Problem("Give the key a name.")
    models = [m.strip() for m in models or [] if m.strip()]
    outside = sorted(set(models) - set(team.model_names)) if team.model_names else []
    if outside:
        raise Problem(f"The team {team} may not use {', '.join(outside)}: choose among {', '.join(team.model_names)}.")
    if expires is not None and expires <= timezone.now():
        raise Problem("The expiry must be in the future.")
    key = ApiKey(
        name=name,
        model_names=models,
        team=team,
        owner=user,
        expires=expires,
        created_by=user.get_username(),
    )
    secret = give_secret(key)
    if ApiKey.objects.filter(name=name).exists():
        raise Problem(f'A key named "{name}" exists already: choose another name.')
    try:
        key.full_clean()
        with transaction.atomic():
            key.save()
    except ValidationError as error:
        raise Problem(describe_problem(error)) from None
    except IntegrityError:
        raise Problem(f'A key named "{name}" exists already: choose another name.') from None
    return key, secret


def revoke_key(user, key_id) -> ApiKey:
    """Turn off a key the user may see (their own, or their admin team's); its usage stays on the books."""
    key = access.keys(user).filter(pk=_number(key_id)).first()
    if key is None:
        raise NotFound("No such key of yours.")
    if not (key.owner_id == user.pk or user.has_perm("gateway.change_apikey") or _admins(user, key.team)):
        raise NotFound("No such key of yours.")
    if key.active:
        key.active = False
        key.save(update_fields=["active"])
    return key


def add_member(user, team_id, who: str, role: str = TeamMember.Role.MEMBER) -> TeamMember:
    team = _managed_team(user, team_id)
    if role not in TeamMember.Role.values:
        raise Problem(f"A role is one of {', '.join(TeamMember.Role.values)}.")
    person = access.find_user(who)
    if person is None:
        raise Problem(f'Nobody here has the username or email "{who.strip()}".')
    member, made = TeamMember.objects.get_or_create(team=team, user=person, defaults={"role": role})
    if not made:
        raise Problem(f"{person.get_username()} is in {team} already.")
    return member


def remove_member(user, member_id) -> None:
    member = access.members(user).filter(pk=_number(member_id)).first()
    if member is None or not access.may_manage_members(user, member.team):
        raise NotFound("No such member of a team you run.")
    if member.from_provider:
        raise Problem(
            f"{member.user.get_username()} is in {member.team} by the identity provider's groups: "
            "remove them there; they leave the team at their next sign-in."
        )
    member.delete()


def _managed_team(user, team_id) -> Team:
    team = access.teams(user).filter(pk=_number(team_id)).first()
    if team is None or not access.may_manage_members(user, team):
        raise NotFound("No such team of yours to run.")
    return team


def _admins(user, team: Team | None) -> bool:
    return team is not None and access.is_team_admin(user, team)


def _number(value) -> int:
    """An id from a form or a URL; anything not a positive integer matches no row."""
    try:
        number = int(value)
    except (TypeError, ValueError):
        return 0
    return number if 0 < number < 2**63 else 0
