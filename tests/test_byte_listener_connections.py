"""The byte listener's pass check costs the database no connection per client (issue 33).

A real byte listener (gunicorn + gevent) on the tests' real PostgreSQL. Under gevent each
greenlet had its own database connection, kept for CONN_MAX_AGE after its request: every
kept-alive client that showed a well-formed pass, right or wrong, held one, and a few
hundred of them reached PostgreSQL's max_connections. Now the node's token hash is read
through a cache (LLMGW_BYTES_PASS_CACHE_S), on a connection closed at once.
"""

from __future__ import annotations

import socket
import time

import pytest
from django.conf import settings
from django.db import connection

from contracts import credentials, signing
from fleet.enrolment import issue_token, revoke_token

from .support.mirror import put
from .support.processes import as_node
from .support.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

WEIGHTS = bytes(range(256)) * 64


def database_connections() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()")
        return cursor.fetchone()[0]


def ask_and_keep_open(port: int, path: str, presented: str) -> tuple[socket.socket, int]:
    """One HTTP/1.1 request on a connection left open afterwards (kept alive): (the socket, the status)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {presented}\r\n\r\n".encode())
    answer = b""
    while b"\r\n\r\n" not in answer:
        chunk = sock.recv(65536)
        assert chunk, f"the byte listener closed the connection: {answer!r}"
        answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    fields = dict(line.lower().split(b":", 1) for line in head.split(b"\r\n")[1:])
    if b"content-length" in fields:
        done = lambda: len(body) >= int(fields[b"content-length"])  # noqa: E731
    else:  # chunked: up to the last, empty chunk
        done = lambda: body.endswith(b"0\r\n\r\n")  # noqa: E731
    while not done():
        body += sock.recv(65536)
    return sock, int(head.split()[1])


@pytest.mark.skipif(settings.DATABASES["default"]["ENGINE"] != "django.db.backends.postgresql", reason="PostgreSQL's")
def test_300_kept_alive_clients_with_wrong_passes_hold_no_database_connection_and_a_node_still_fetches(
    byte_listener, mirror_root, fleet_node
):
    put(mirror_root, "m", "v1", {"a.bin": WEIGHTS})
    port = int(byte_listener.rstrip("/").rsplit(":", 1)[1])
    victim = issue_token("victim")
    before = database_connections()
    held = []
    try:
        for i in range(300):
            # Well-formed passes, each wrong: an enrolled node's name on a guessed key, and names nobody has.
            name = "victim" if i % 3 else f"stranger-{i}"
            guess = credentials.bytes_pass(signing.token_hash(f"a guess {i}"), name)
            sock, status = ask_and_keep_open(port, "/m/v1/a.bin", guess)
            held.append(sock)
            assert status == 401
        during = database_connections()
        # The pass check reads on at most a few connections at once, each closed as soon as it has read.
        assert during - before <= 5, f"{during - before} more connections to PostgreSQL with 300 clients held open"
        # And a node with its right pass fetches meanwhile, as does the enrolled node whose name was guessed.
        assert as_node.get(byte_listener + "m/v1/a.bin", timeout=30).content == WEIGHTS
        right = credentials.bytes_pass(signing.token_hash(victim), "victim")
        sock, status = ask_and_keep_open(port, "/m/v1/a.bin", right)
        held.append(sock)
        assert status == 200
    finally:
        for sock in held:
            sock.close()


def test_a_revoked_token_is_refused_within_the_pass_cache_seconds_and_one_issued_anew_works_at_once(
    byte_listener, mirror_root
):
    put(mirror_root, "m", "v1", {"a.bin": WEIGHTS})
    token = issue_token("short-lived")
    url = byte_listener + "m/v1/a.bin"

    def status_with(token: str) -> int:
        presented = credentials.bytes_pass(signing.token_hash(token), "short-lived")
        return as_node.get(url, headers=credentials.bearer(presented), auth=None, timeout=30).status_code

    assert status_with(token) == 200
    assert revoke_token("short-lived")
    revoked = time.monotonic()
    wait_until(lambda: status_with(token) == 401, timeout=60, what="the byte listener to refuse the revoked token")
    # LLMGW_BYTES_PASS_CACHE_S (2 s by default) is the bound; the rest is slack for a loaded machine.
    assert time.monotonic() - revoked < settings.BYTES_PASS_CACHE_S + 5
    # A token issued anew is a pass the cache does not know: the node is read again at its first request.
    assert status_with(issue_token("short-lived")) == 200
