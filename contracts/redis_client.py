"""The one Redis client factory of every llmgw process: one connection pool per process and address.

The control plane (`fleet.live.redis_client`) and the node's agent
(`agent.progress.redis_client`) both ask here with their settings' REDIS_URL. Before,
each call made a client with a pool of its own, so every replica report, heartbeat
and page opened (and dropped) a connection; now the calls of one process share a pool,
and a connection is opened once and reused.

redis-py's pool notices a fork (it compares the pid) and starts afresh in the child,
so a pool made before a Celery or gunicorn worker forked is never shared with it.
No Django here: the callers pass the address.
"""

from __future__ import annotations

import threading

import redis

_pools: dict[tuple[str, float], redis.ConnectionPool] = {}
_lock = threading.Lock()


def redis_client(url: str, timeout: float = 5.0) -> redis.Redis:
    """A client on this process's pool for `url`, whose connects and replies time out after `timeout` s."""
    key = (url, timeout)
    pool = _pools.get(key)
    if pool is None:
        with _lock:
            pool = _pools.get(key)
            if pool is None:
                pool = redis.ConnectionPool.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
                _pools[key] = pool
    return redis.Redis(connection_pool=pool)
