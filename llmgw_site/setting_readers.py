"""The control plane's settings that take more reading than contracts.env's typed helpers.

A key made once under var/, lists, a port range, networks, a time zone, the sign-in
provider's address: each read and checked here, so a wrong value stops llmgw at start
with a sentence naming the variable (manage.py prints it), never later with a traceback.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import zoneinfo
from pathlib import Path
from urllib.parse import urlsplit

from django.core.exceptions import ImproperlyConfigured

from contracts.env import SettingError, env_str


def secret_key(var_dir: Path) -> str:
    """DJANGO_SECRET_KEY; on one machine without it, a key made once and kept under var/, so sessions survive a restart."""
    key = env_str("DJANGO_SECRET_KEY", "")
    if key:
        return key
    key_file = var_dir / "secret_key"
    if key_file.exists():
        return key_file.read_text().strip()
    var_dir.mkdir(parents=True, exist_ok=True)
    key = secrets.token_urlsafe(50)
    # Made with its mode, written whole, then linked into place: no reader ever sees it
    # readable by others or half-written, whatever the umask, and of two processes
    # starting together the second keeps the first one's key.
    tmp = var_dir / f".secret_key.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(key)
        os.link(tmp, key_file)
    except FileExistsError:
        key = key_file.read_text().strip()
    finally:
        tmp.unlink(missing_ok=True)
    return key


def env_list(name: str, default: str) -> list[str]:
    """A comma-separated value's items, each stripped, empty ones dropped."""
    return [item.strip() for item in env_str(name, default).split(",") if item.strip()]


def port_range(name: str, value: str) -> tuple[int, int]:
    """FIRST-LAST, two unprivileged ports, as (first, last)."""
    try:
        low, high = (int(p) for p in value.split("-"))
        if not 1024 <= low <= high <= 65535:
            raise ValueError
    except ValueError:
        raise ImproperlyConfigured(
            f"{name} is {value!r}: it must be FIRST-LAST, two ports between 1024 and 65535, first <= last"
        ) from None
    return low, high


def env_networks(name: str) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    """Addresses or networks separated by commas; an address is a network of one."""
    networks = []
    for item in env_str(name, "").split(","):
        if item.strip():
            try:
                networks.append(ipaddress.ip_network(item.strip(), strict=False))
            except ValueError:
                raise ImproperlyConfigured(
                    f"{name} must be IP addresses or networks separated by commas, not {item.strip()!r}"
                ) from None
    return networks


def env_time_zone(name: str, default: str) -> str:
    """A time zone's name this machine knows, like UTC or Europe/Paris."""
    value = env_str(name, default)
    try:
        zoneinfo.ZoneInfo(value)
    except (ValueError, zoneinfo.ZoneInfoNotFoundError):
        raise ImproperlyConfigured(
            f"{name} is {value!r}, which is not a time zone this machine knows; write one like UTC or Europe/Paris."
        ) from None
    return value


def oidc_issuer_host(issuer: str) -> str:
    """The sign-in provider's host name, once its address is one whose keys no network in between could swap.

    Over plain HTTP a network in between could swap the provider's keys: only for one on this host.
    """
    parts = urlsplit(issuer)
    if (
        parts.scheme not in ("https", "http")
        or not parts.hostname
        or parts.query
        or parts.fragment
        or (parts.scheme == "http" and parts.hostname not in ("127.0.0.1", "::1", "localhost"))
    ):
        raise SettingError(
            "LLMGW_OIDC_ISSUER must be the provider's https:// address, like https://login.example.org/realms/org "
            f"(http:// only for a provider on this host), not {issuer!r}"
        )
    return parts.hostname
