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


def create_key(name: str, models: list[str] | None = None, created_by: str = "") -> tuple[ApiKey, str]:
    """A new key: the record, and the key itself, which is shown once and never stored."""
    secret = new_secret()
    key = ApiKey(
        name=name.strip(),
        model_names=list(models or []),
        created_by=created_by,
        prefix=secret[:12],
        key_hash=hash_key(secret),
    )
    key.full_clean()
    key.save()
    return key, secret


def describe_problem(error: ValidationError) -> str:
    """A ValidationError as one sentence for a command line."""
    if hasattr(error, "message_dict"):
        return " ".join(f"{field}: {' '.join(messages)}" for field, messages in error.message_dict.items())
    return " ".join(error.messages)
