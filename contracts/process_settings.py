"""The Django settings every llmgw process shares, node and control plane alike: the broker and
the log format. `agent/settings.py` and `llmgw_site/settings.py` take them with a star import
and add their own (the control plane its task routes, beat and quieter database log)."""

from __future__ import annotations

from .env import env_bool, env_int, env_str

__all__ = [
    "REDIS_URL",
    "CELERY_BROKER_URL",
    "CELERY_RESULT_BACKEND",
    "CELERY_TASK_IGNORE_RESULT",
    "CELERY_ACCEPT_CONTENT",
    "CELERY_TASK_SERIALIZER",
    "CELERY_RESULT_SERIALIZER",
    "CELERY_TASK_DEFAULT_QUEUE",
    "CELERY_WORKER_PREFETCH_MULTIPLIER",
    "CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP",
    "CELERY_BROKER_TRANSPORT_OPTIONS",
    "CELERY_WORKER_ENABLE_REMOTE_CONTROL",
    "CELERY_WORKER_SEND_TASK_EVENTS",
    "CELERY_TASK_SEND_SENT_EVENT",
    "REDIS_ACL",
    "LOGGING",
]

REDIS_URL = env_str("REDIS_URL", "redis://127.0.0.1:6379/0")
CELERY_BROKER_URL = REDIS_URL
CELERY_RESULT_BACKEND = None
CELERY_TASK_IGNORE_RESULT = True
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
# What is sent without a queue goes to the control queue; a node's sends name it (contracts.tasks),
# and nothing may land on a queue no one reads.
CELERY_TASK_DEFAULT_QUEUE = "control"
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# Longer than the longest fetch: Redis re-delivers an unacknowledged task after this, and
# a multi-hour download must not be started a second time underneath itself.
# priority_steps [0]: a queue is one Redis list, named as the queue (kombu's default reads
# four suffixed lists too), so a node's Redis user is given exactly `node.NAME` (fleet/redis_acl.py).
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "visibility_timeout": env_int("LLMGW_VISIBILITY_TIMEOUT_S", 12 * 3600, minimum=60),
    "priority_steps": [0],
}
# A worker takes orders from its queue only: remote control (`celery control shutdown`,
# `add_consumer`, `cancel_consumer`) and events are fanout channels anyone on Redis may
# publish on (issue 33). contracts/celery_app.py forces these and turns gossip, mingle and
# the event heartbeat off.
CELERY_WORKER_ENABLE_REMOTE_CONTROL = False
CELERY_WORKER_SEND_TASK_EVENTS = False
CELERY_TASK_SEND_SENT_EVENT = False
# Each principal its own Redis user (docs/fleet.md, "Redis users"): a node then makes its
# user and password from its name and token (contracts.credentials.redis_password).
REDIS_ACL = env_bool("LLMGW_REDIS_ACL", False)

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env_str("LLMGW_LOG_LEVEL", "INFO")},
}
