"""Secrets shown once (an API key, a node's enrolment token): kept server-side until their page is shown, then gone.

Django's messages used to carry them, in a signed cookie anyone can read (signed is not
sealed), kept by the browser and by whatever logs headers on the way. Here they wait in
the session, which is the database's, under the user who made them, and the page that
shows them takes them out: a second look finds nothing.
"""

from __future__ import annotations

from django.http import HttpRequest

SESSION_KEY = "llmgw_one_time_secrets"


def keep(request: HttpRequest, what: str, secret: str) -> None:
    """Keep `secret` for this user's next look at the one-time page; `what` says whose it is."""
    request.session[SESSION_KEY] = [*request.session.get(SESSION_KEY, []), {"what": what, "secret": secret}]


def take(request: HttpRequest) -> list[dict]:
    """The secrets waiting for this user, removed as they are read."""
    return request.session.pop(SESSION_KEY, [])


def waiting(request: HttpRequest) -> bool:
    return bool(request.session.get(SESSION_KEY))
