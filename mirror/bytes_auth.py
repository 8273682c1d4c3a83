"""Who may read the mirror: the fleet's nodes, each with a pass made from its enrolment token.

For a private fleet the weights are often the thing that must not leave, and the byte
listener listens where every node can reach it. So every request presents a node's
pass (`Authorization: Bearer NODE:EXPIRES:MAC`, contracts.credentials), checked
against that node's token hash on every request. The hashes are cached in the process
for LLMGW_BYTES_PASS_CACHE_S seconds (a database connection per client is what ran
PostgreSQL out of connections, issue 33): a node whose token is revoked gets 401 within
that many seconds, a fetch under way included; a token issued anew works at once, or
within a second when its node's re-reads are spent (a pass that does not match is checked
against the database again, at most five times a second per node). The operator may open the mirror to anyone with LLMGW_BYTES_PUBLIC=true.

The mirror sits below the fleet and does not know what a node is: the lookup of a
node's token hash is handed in by the byte listener's URLconf (`llmgw_site.urls_bytes`).
"""

from __future__ import annotations

import base64
import binascii
import functools
import time
from typing import Protocol

from django.conf import settings
from django.db import DatabaseError
from django.http import HttpRequest, JsonResponse

from contracts.credentials import bytes_pass_problem

ANONYMOUS = (
    "the byte listener serves only the fleet's nodes, and this request presented no node's pass "
    "(a node's agent sends one by itself; `manage.py fetch` makes one from LLMGW_NODE_NAME and LLMGW_NODE_TOKEN); "
    "LLMGW_BYTES_PUBLIC=true on the byte listener opens the mirror to anyone"
)


class Nodes(Protocol):
    """The fleet's nodes as the byte listener sees them (fleet.enrolment.EnrolledNodes)."""

    def token_hash_of(self, name: str) -> str | None: ...

    def read_again(self, name: str) -> bool: ...


def _refused(status: int, sentence: str) -> JsonResponse:
    response = JsonResponse({"error": sentence}, status=status)
    if status == 401:
        response["WWW-Authenticate"] = 'Bearer realm="llmgw mirror"'
    return response


def _checked(presented: str, nodes: Nodes) -> str | None:
    asked: list[str] = []

    def key_of(name: str) -> str | None:
        asked.append(name)
        return nodes.token_hash_of(name)

    problem = bytes_pass_problem(presented, key_of)
    if problem is None or not asked:
        return problem
    # Not the cached hash's pass: perhaps one of a token issued since it was read. Read again,
    # at most a few times a second per node, so a flood of wrong passes costs no query per client.
    # When this second's re-reads are spent, wait for the next second's rather than refuse: a
    # token issued anew is not refused because its node's re-reads of this second went to other
    # passes (new tokens of the same node, or a few wrong ones); it waits. The wait is a greenlet's
    # (the byte listener runs under gevent), and the re-reads stay at most a few a second.
    if not nodes.read_again(asked[0]):
        time.sleep(1.0 - time.monotonic() % 1.0 + 0.001)
        if not nodes.read_again(asked[0]):
            return problem
    return bytes_pass_problem(presented, nodes.token_hash_of)


def problem_of(request: HttpRequest, nodes: Nodes) -> str | None:
    """Why this request may not read the mirror, or None.

    The pass comes as `Bearer NODE:EXPIRES:MAC`, or as HTTP Basic with the node's name as
    the user and the pass as the password: what a BitTorrent web seed (libtorrent) sends
    for a URL's `user:password@` (issue 24). The same pass either way, checked the same way.
    """
    scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
    presented = presented.strip()
    if scheme.lower() == "basic" and presented:
        try:
            user, colon, password = base64.b64decode(presented, validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return "the Basic credential is not base64 of NODE:PASS"
        if not colon or not password.startswith(user + ":"):
            return "a Basic credential names the node as its user and carries the node's pass (NODE:EXPIRES:MAC)"
        return _checked(password, nodes)
    if scheme.lower() != "bearer" or not presented:
        return ANONYMOUS
    return _checked(presented, nodes)


def only_the_fleet(view, nodes: Nodes):
    """`view`, answered only to a node with a current pass (or to anyone when the mirror is public)."""

    @functools.wraps(view)
    def wrapped(request: HttpRequest, *args, **kwargs):
        if not settings.BYTES_PUBLIC:
            try:
                problem = problem_of(request, nodes)
            except DatabaseError:
                return _refused(503, "the byte listener cannot check the node's pass: its database does not answer")
            if problem is not None:
                return _refused(401, problem)
        return view(request, *args, **kwargs)

    return wrapped
