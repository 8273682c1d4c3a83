"""Why requests went to a replica: what the gateways write to Redis, and what the replica's page reads.

The gateway chooses a replica by the conversation's prefix, bounded by load, or by
load alone (gateway/prefix.py), and says why for every request in its access log.
For the replica's page each gateway also adds, about once a second from a thread,
its counts per replica and reason for the hour (ROUTES_HOUR_PREFIX) and the replica's
last RECENT requests (RECENT_PREFIX): nothing of a request's content, only when, the
model, why, and its prompt's tokens and how many of them the engine had cached.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta

from .live import redis_client

ROUTES_HOUR_PREFIX = "llmgw:routes-hour:"  # + YYYYMMDDHH: a hash of "<replica>\t<reason>" -> requests
RECENT_PREFIX = "llmgw:replica-recent:"  # + replica id: a list of JSON objects, newest first
RECENT = 20
KEEP_S = 26 * 3600


def add(pipe, hour: str, replica: int, reason: str, requests: int) -> None:
    """Into a pipeline: `requests` more sent to `replica` for `reason` in `hour`."""
    key = ROUTES_HOUR_PREFIX + hour
    pipe.hincrby(key, f"{replica}\t{reason}", requests)
    pipe.expire(key, KEEP_S)


def note(pipe, replica: int, requests: list[dict]) -> None:
    """Into a pipeline: a replica's latest requests, oldest first in `requests`."""
    key = RECENT_PREFIX + str(replica)
    pipe.lpush(key, *(json.dumps(r, separators=(",", ":")) for r in requests))
    pipe.ltrim(key, 0, RECENT - 1)
    pipe.expire(key, KEEP_S)


def routed_to(replica: int, client=None) -> tuple[dict[str, int], list[dict]]:
    """({reason: requests in the last 24 hours}, its last requests, newest first); empty when Redis is away."""
    now = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    hours = [(now - timedelta(hours=n)).strftime("%Y%m%d%H") for n in range(24)]
    mine = f"{replica}\t".encode()
    counts: dict[str, int] = {}
    try:
        pipe = (client or redis_client()).pipeline(transaction=False)
        for hour in hours:
            pipe.hgetall(ROUTES_HOUR_PREFIX + hour)
        pipe.lrange(RECENT_PREFIX + str(replica), 0, RECENT - 1)
        *by_hour, recent = pipe.execute()
    except Exception:
        return {}, []
    for fields in by_hour:
        for field, value in fields.items():
            if field.startswith(mine):
                reason = field[len(mine) :].decode()
                counts[reason] = counts.get(reason, 0) + int(value)
    latest = []
    for raw in recent:
        try:
            entry = json.loads(raw)
        except ValueError:
            continue
        if isinstance(entry, dict):
            latest.append(entry)
    return counts, latest


def when(at) -> str:
    try:
        return time.strftime("%H:%M:%S", time.gmtime(float(at)))
    except (TypeError, ValueError):
        return "?"
