"""The gateway's sockets to replicas: a host that vanishes is found out in seconds, not minutes.

A replica's node can vanish without a word: its link down, its power gone. Nothing
then resets the gateway's connections to it, and a request sent on one (a kept-alive
connection is reused without a new connect, so the connect timeout never applies)
waited for LLMGW_GATEWAY_UPSTREAM_TIMEOUT_S, ten minutes, before its 504, though
another replica stood ready. A slow engine is not that: its host's kernel acknowledges
every byte at once, however long the answer takes. So each socket gives up once what
it sent has gone unacknowledged, or its keepalive probes unanswered, for
LLMGW_GATEWAY_UPSTREAM_LOST_S; the request then fails as a refused connection does,
and goes to another replica when nothing of its answer has been passed on yet.
"""

from __future__ import annotations

import socket

from django.conf import settings

# Engines close a kept-alive connection idle for 5 s (llama-server's cpp-httplib, and uvicorn
# under vLLM). A request sent on one as the engine closes it fails though the engine is well,
# and cooled its replica for COOLDOWN_S: under steady load every client waited 5 s now and
# then (bench/engine.py, p95). The gateway lets its idle connections go sooner.
IDLE_S = 2.0


def upstream_socket(addr_info) -> socket.socket:
    """aiohttp's `socket_factory`: a TCP socket that notices a peer gone silent."""
    family, type_, proto, _, _ = addr_info
    sock = socket.socket(family=family, type=type_, proto=proto)
    lost = settings.GATEWAY_UPSTREAM_LOST_S
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    # Linux's names; elsewhere the keepalive defaults (hours) and the upstream timeout stand.
    for name, value in (
        ("TCP_KEEPIDLE", max(1, lost // 3)),
        ("TCP_KEEPINTVL", max(1, lost // 6)),
        ("TCP_KEEPCNT", 3),
        ("TCP_USER_TIMEOUT", lost * 1000),
    ):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    return sock
