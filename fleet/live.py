"""The control plane's connection to what nodes publish live in Redis (the key format is in contracts)."""

import redis
from django.conf import settings

from contracts.redis_client import redis_client as pooled_client


def redis_client() -> redis.Redis:
    """The control plane's Redis: a client on this process's one pool (contracts.redis_client)."""
    return pooled_client(settings.REDIS_URL)


# When the control plane began hearing the fleet, and its last reconcile pass: a hash in Redis.
LISTENING_KEY = "llmgw:control-listening"


def listening_since(client: redis.Redis, now: float, gap_s: float) -> float:
    """Since when the control plane has listened without a gap longer than `gap_s`; `now` is this pass.

    A node is lost when it was silent while the control plane listened, not while
    the control plane itself was down: the first pass after the control worker
    restarted found every node's last heartbeat too old, took them all for lost and
    placed every replica again, before the nodes' next heartbeats came in. No record
    (a first pass, or a Redis that lost its data) is a gap too.
    Called under the reconcile lock, so one pass at a time reads and writes it.
    """
    last, since = client.hmget(LISTENING_KEY, "last", "since")
    if last is None or since is None or now - float(last) > gap_s:
        since = now
    client.hset(LISTENING_KEY, mapping={"last": now, "since": float(since)})
    return float(since)
