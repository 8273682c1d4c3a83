"""Sources' addresses as the swarm names and filters them: a host resolved, a URL's server, a URL without its pass."""

from __future__ import annotations

import functools
import ipaddress
import socket
from urllib.parse import urlsplit


def resolve(host: str) -> str | None:
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        return socket.gethostbyname(host)
    except OSError:
        return None


@functools.lru_cache(maxsize=256)
def server(url: str) -> tuple[str | None, int]:
    """(address, port) of a URL's server: what a web seed's connection is to."""
    parts = urlsplit(url)
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        port = -1
    return resolve(parts.hostname or ""), port


def without_credentials(url: str) -> str:
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]).geturl()


def endpoint(alert) -> str:
    try:
        host, port = alert.endpoint if hasattr(alert, "endpoint") else alert.ip
        return f"{host}:{port}"
    except (AttributeError, TypeError, ValueError):
        return "?"


def called(value):
    """A list given as it is, or as a callable asked again every time."""
    return list(value() if callable(value) else value)
