"""Making and checking staff users' API tokens: the one place both the API and /metrics ask."""

from __future__ import annotations

import hashlib
import secrets
from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from .models import ApiToken

# A token's last use is written at most this often: not a database write per request.
LAST_USED_EVERY = timedelta(minutes=1)


def key_hash(key: str) -> str:
    # A token is 160 random bits: a fast hash is as good as a slow one against guessing.
    return hashlib.sha256(key.encode()).hexdigest()


def issue(user) -> str:
    """A new token for this user, good for LLMGW_API_TOKEN_DAYS; the only time it is seen.

    The user's earlier tokens keep working until they expire; expired ones are removed.
    """
    key = secrets.token_hex(20)
    now = timezone.now()
    ApiToken.objects.filter(user=user, expires__lte=now).delete()
    ApiToken.objects.create(
        user=user,
        key_hash=key_hash(key),
        prefix=key[:8],
        created=now,
        expires=now + timedelta(days=settings.API_TOKEN_DAYS),
    )
    return key


def check(key: str) -> tuple[ApiToken | None, str | None]:
    """(the token, None) when `key` signs in its user, or (None, why it does not) in a sentence."""
    token = ApiToken.objects.select_related("user").filter(key_hash=key_hash(key)).first()
    if token is None:
        return None, "The API token is not one llmgw knows (mistyped, or revoked)."
    now = timezone.now()
    if token.expires <= now:
        return None, (
            f"The API token expired at {token.expires:%Y-%m-%d %H:%M} UTC; "
            f"a new one comes from `manage.py api_token {token.user.get_username()}`."
        )
    if not token.user.is_active:
        return None, f"The API token's user, {token.user.get_username()}, is no longer active."
    if token.last_used is None or token.last_used < now - LAST_USED_EVERY:
        ApiToken.objects.filter(pk=token.pk).update(last_used=now)
    return token, None
