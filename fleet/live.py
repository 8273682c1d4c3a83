"""The control plane's connection to what nodes publish live in Redis (the key format is in contracts)."""

import redis
from django.conf import settings


def redis_client() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=5, socket_connect_timeout=5)
