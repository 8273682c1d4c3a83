"""One Redis client per process, pooled, from one factory (contracts.redis_client).

Before, each call made a client with its own pool: a control worker opened a new
connection for every replica report and heartbeat it recorded. The count of
connections the tests' Redis has accepted shows the difference.
"""

from __future__ import annotations

import redis
from django.conf import settings

from agent import progress
from contracts.redis_client import redis_client
from fleet import live, reports


def accepted() -> int:
    """Connections the tests' Redis has accepted so far, asked on a connection of its own (which counts 1)."""
    with redis.Redis.from_url(settings.REDIS_URL) as client:
        return int(client.info("stats")["total_connections_received"])


def test_the_control_plane_and_the_agent_share_one_pool_per_process_and_address():
    assert live.redis_client().connection_pool is live.redis_client().connection_pool
    assert progress.redis_client().connection_pool is live.redis_client().connection_pool
    assert redis_client(settings.REDIS_URL, timeout=1).connection_pool is not live.redis_client().connection_pool


def test_a_thousand_heartbeats_recorded_open_one_connection_not_a_thousand():
    live.redis_client().ping()  # the pool's first connection, made before counting
    before = accepted()
    for i in range(1000):
        reports.record_running(f"n{i % 7}", [1, 2, 3])
    assert reports.running_on(["n1"]) == {"n1": {1, 2, 3}}
    # The two asks of accepted() count two; the records themselves reused the pool's connection.
    assert accepted() - before <= 2
