"""Small typed readers for settings that come from the environment.

A wrong value stops the process at start with a sentence naming the variable,
rather than surfacing later as a traceback deep inside whatever used it.
"""

import os
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured


def env_str(name: str, default: str) -> str:
    value = os.environ.get(name, "").strip()
    return value or default


def env_int(name: str, default: int, minimum: int = 0) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be a whole number, not {raw!r}") from None
    if value < minimum:
        raise ImproperlyConfigured(f"{name} must be at least {minimum}, not {value}")
    return value


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in {"1", "true", "yes", "on"}:
        return True
    if raw in {"0", "false", "no", "off"}:
        return False
    raise ImproperlyConfigured(f"{name} must be true or false, not {raw!r}")


def env_path(name: str, default: Path, base: Path) -> Path:
    raw = os.environ.get(name, "").strip()
    path = Path(raw) if raw else default
    if not path.is_absolute():
        path = base / path
    return path


def env_addr(name: str, default: str) -> tuple[str, int]:
    """A listening address written HOST:PORT."""
    raw = env_str(name, default)
    host, sep, port = raw.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ImproperlyConfigured(f"{name} must be written HOST:PORT, like 127.0.0.1:8001, not {raw!r}")
    return host, int(port)
