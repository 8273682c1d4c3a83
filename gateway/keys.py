"""Making API keys and recognising them."""

from __future__ import annotations

import hashlib
import secrets

from django.core.exceptions import ValidationError

from .models import ApiKey

PREFIX = "llmgw-"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_secret() -> str:
    return PREFIX + secrets.token_urlsafe(32)


def give_secret(key: ApiKey) -> str:
    """A new secret for this key (unsaved): the record keeps its prefix and hash, the caller shows the rest once."""
    secret = new_secret()
    key.prefix, key.key_hash = secret[:12], hash_key(secret)
    return secret


def create_key(
    name: str, models: list[str] | None = None, created_by: str = "", limits: dict | None = None
) -> tuple[ApiKey, str]:
    """A new key: the record, and the key itself, which is shown once and never stored.

    `limits` maps names of LIMIT_FIELDS to a number, or None/0 for no limit.
    """
    key = ApiKey(name=name.strip(), model_names=list(models or []), created_by=created_by)
    for field, value in (limits or {}).items():
        setattr(key, field, value or None)
    secret = give_secret(key)
    key.full_clean()
    key.save()
    return key, secret


def describe_problem(error: ValidationError) -> str:
    """A ValidationError as one sentence for a command line."""
    if hasattr(error, "message_dict"):
        return " ".join(f"{field}: {' '.join(messages)}" for field, messages in error.message_dict.items())
    return " ".join(error.messages)
