"""`/healthz` of the control plane's Django processes: the admin server and the byte listener.

What each needs, checked at the moment of the request (contracts/health.py gives the shape):
the admin server its database and Redis (Celery's broker, the fleet's live state), the
byte listener its database (the nodes' passes) and the mirror's directory. Neither
check reads a session or a user, so a load balancer needs no credentials, and the answer
names only what was checked, never an address or a password.
"""

from __future__ import annotations

from django.conf import settings
from django.db import connections
from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_safe

from contracts.health import Check, verdict
from contracts.redis_client import redis_client

# A health check answers within a load balancer's patience, whatever is away.
TIMEOUT_S = 2.0


def database() -> None:
    connection = connections["default"]
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    except Exception:
        connection.close()  # the next request connects anew rather than reusing a broken connection
        raise


def redis() -> None:
    redis_client(settings.REDIS_URL, timeout=TIMEOUT_S).ping()


def mirror_root() -> str:
    root = settings.MIRROR_ROOT
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory")
    next(root.iterdir(), None)  # readable, not merely there
    return str(root)


ADMIN_CHECKS = [
    Check("database", database, without="cannot show pages or the API"),
    Check("redis", redis, without="cannot queue work or hear the fleet"),
]
BYTES_CHECKS = [
    Check("database", database, without="cannot check a node's pass"),
    Check("mirror", mirror_root, without="has no files to serve"),
]


def answer(process: str, checks: list[Check]) -> HttpResponse:
    status, body = verdict(process, checks)
    response = HttpResponse(body, status=status, content_type="application/json")
    response["Cache-Control"] = "no-store"
    return response


@require_safe
def admin_health(request: HttpRequest) -> HttpResponse:
    return answer("admin server", ADMIN_CHECKS)


@require_safe
def bytes_health(request: HttpRequest) -> HttpResponse:
    return answer("byte listener", BYTES_CHECKS)
