"""The key the playground talks to the gateway with: the signed-in person's own page key.

One ApiKey per person, named "playground: <username>", owned by them and in their team
(so the team's models, limits and budget apply). Its secret lives only in the
server-side session (Django's database-backed sessions, never a signed cookie): a new
page session gives the key a new secret, and the browser never sees one.
"""

from __future__ import annotations

from django.contrib.auth.models import AbstractBaseUser

from catalog.models import Model
from gateway.keys import give_secret, hash_key
from gateway.models import ApiKey

SESSION_SECRET = "playground_secret"


def key_name(user: AbstractBaseUser) -> str:
    return f"playground: {user.get_username()}"


def page_key(request) -> tuple[ApiKey, str]:
    """The person's page key and its secret; the secret made anew when this session has none that still holds."""
    user = request.user
    membership = user.team_memberships.select_related("team").order_by("pk").first()
    key, _ = ApiKey.objects.get_or_create(
        name=key_name(user),
        defaults={
            "owner": user,
            "team": membership.team if membership else None,
            "created_by": user.get_username(),
            "key_hash": hash_key(key_name(user)),  # replaced below before anyone can use it
        },
    )
    secret = request.session.get(SESSION_SECRET)
    if secret and hash_key(secret) == key.key_hash:
        return key, secret
    secret = give_secret(key)
    key.save(update_fields=["prefix", "key_hash"])
    request.session[SESSION_SECRET] = secret
    return key, secret


def models_for(key: ApiKey) -> list[str]:
    """Catalog models this key may use: its own list, narrowed by its team's."""
    names = list(Model.objects.order_by("name").values_list("name", flat=True))
    for allowed in (key.model_names, key.team.model_names if key.team_id else []):
        if allowed:
            names = [name for name in names if name in allowed]
    return names
