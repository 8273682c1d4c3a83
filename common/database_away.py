"""The admin port while PostgreSQL is away: a 503 with a sentence, never a traceback (docs/failures.md).

A page, the API, the admin's login and /me/ all read the session or the user from the
database. With it stopped each answered 500 with Django's error page (its traceback with
DEBUG on) and one traceback per request in the log: a minute's outage under load was
thousands of them, and an operator read a bug where there was only an outage.
"""

from __future__ import annotations

import logging
import sys
import threading
import time

from django.core.signals import got_request_exception
from django.db import InterfaceError, OperationalError
from django.http import HttpResponse, JsonResponse

log = logging.getLogger(__name__)

SAID = "The database is not answering now; llmgw goes on once it is back. Try again in a moment."
RETRY_AFTER_S = 5
# One line per outage, not one per request: a burst is requests less than this apart.
BURST_S = 60
DATABASE_AWAY = (OperationalError, InterfaceError)

_PAGE = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>llmgw: the database is away</title></head>
<body><h1>The database is not answering</h1><p>{SAID}</p></body></html>
"""
_MARK = "_llmgw_database_away"
_lock = threading.Lock()
_last_seen = 0.0


class DatabaseAwayMiddleware:
    """Outermost, so it also answers for the session and authentication middleware, which read the database."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        response = self.get_response(request)
        # Raised in a middleware inside this one: Django already made it a 500 (and logged
        # it); the signal below marked the request.
        if getattr(request, _MARK, None) is not None:
            return away(request, getattr(request, _MARK))
        return response

    def process_exception(self, request, exception):
        # Raised in a view or while rendering: answered here, before Django logs a traceback.
        return away(request, exception) if isinstance(exception, DATABASE_AWAY) else None


def away(request, exception: BaseException) -> HttpResponse:
    """The 503 that says the database is away: JSON for /api/, a short page otherwise."""
    _log_once_per_burst(exception)
    if request.path.startswith("/api/"):
        response = JsonResponse({"detail": SAID}, status=503)
    else:
        response = HttpResponse(_PAGE, status=503, content_type="text/html; charset=utf-8")
    response["Retry-After"] = str(RETRY_AFTER_S)
    return response


def _log_once_per_burst(exception: BaseException) -> None:
    global _last_seen
    now = time.monotonic()
    with _lock:
        first = now - _last_seen > BURST_S
        _last_seen = now
    if first:
        first_line = str(exception).strip().splitlines()[0] if str(exception).strip() else type(exception).__name__
        log.error("the database is not answering (%s); pages and the API answer 503 until it is back", first_line)


def _mark(sender, request=None, **kwargs) -> None:
    exception = sys.exc_info()[1]
    if request is not None and isinstance(exception, DATABASE_AWAY):
        setattr(request, _MARK, exception)


got_request_exception.connect(_mark, dispatch_uid="llmgw-database-away")
