"""A node's settings: what `manage.py agent` and `manage.py fetch` run with (manage.py
chooses them), and the agent's Celery app (agent/celery.py) reads.

Nothing of the control plane: no database (what a node says goes back as a task on the
control queue or a key in Redis), no URLconf, no admin, and no import of the control
plane's settings module, so a node needs only what requirements/node.txt installs and
the variables deploy/env/node.env sets. Every value comes from the environment, read
with the same readers (contracts.env) and the same defaults as the control plane's
settings, which read the shared ones (REDIS_URL, LLMGW_BYTES_URL, LLMGW_HEARTBEAT_S, ...)
for their own side.
"""

import os
from pathlib import Path

from contracts.credentials import node_redis_url
from contracts.env import env_addr, env_bool, env_int, env_path, env_str
from contracts.keys import unacked_keys
from contracts.signing import token_hash

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = env_path("LLMGW_VAR", Path("var"), BASE_DIR)

ROLE = "node"

# No SECRET_KEY: a node signs nothing with Django's (its proofs are made from its token).
DEBUG = False
ALLOWED_HOSTS: list[str] = []

INSTALLED_APPS = ["agent"]
MIDDLEWARE: list[str] = []
# A node has no database credentials, and no URLconf: the system checks Celery runs at a
# worker's start find nothing of the control plane to import.
DATABASES: dict = {}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
TIME_ZONE = "UTC"
USE_TZ = True
USE_I18N = False

# --- where things are ---------------------------------------------------------

# The byte listener as this node reaches it: the one host and port it fetches from.
_bytes_host, _bytes_port = env_addr("LLMGW_BYTES_ADDR", "127.0.0.1:8001")
if _bytes_host in {"0.0.0.0", "::", ""}:
    _bytes_host = "127.0.0.1"
BYTES_URL = env_str("LLMGW_BYTES_URL", f"http://{_bytes_host}:{_bytes_port}/").rstrip("/") + "/"
HEARTBEAT_S = env_int("LLMGW_HEARTBEAT_S", 15, minimum=1)
# How often a running agent probes its installed engines and GPUs again.
AGENT_REPROBE_S = env_int("LLMGW_AGENT_REPROBE_S", 300, minimum=1)
# Fetched files and sets, under <host>_<port>/<path>.
AGENT_CACHE = env_path("LLMGW_AGENT_CACHE", VAR_DIR / "agent-cache", BASE_DIR)
# The cache's bounds (agent/cache_evict.py): sets no replica uses are evicted, unused the longest
# first, while the cache holds more than this many GB or its disk has less than this many GB free. 0: no bound.
NODE_CACHE_MAX_GB = env_int("LLMGW_NODE_CACHE_MAX_GB", 0, minimum=0)
NODE_CACHE_FREE_GB = env_int("LLMGW_NODE_CACHE_FREE_GB", 0, minimum=0)
# Files of one set fetched at once: one TCP stream rarely fills a fast link.
FETCH_PARALLEL = env_int("LLMGW_FETCH_PARALLEL", 4, minimum=1)
# How long a fetch waits on a mirror version that is not ready yet (a file still being copied in).
FETCH_WAIT_S = env_int("LLMGW_FETCH_WAIT_S", 6 * 3600, minimum=1)
# Connections to the byte listener a set's fetch opens (its web seed URLs, agent/peers.py), until a peer holds the set.
FETCH_CONNECTIONS = env_int("LLMGW_FETCH_CONNECTIONS", 8, minimum=1)
# A source (a peer, the mirror as web seed) sending less than this for this long loses its pieces to the others.
FETCH_STALL_BYTES_S = env_int("LLMGW_FETCH_STALL_BYTES_S", 1 << 20, minimum=1)
FETCH_STALL_S = env_int("LLMGW_FETCH_STALL_S", 20, minimum=1)
# False: every set from the mirror over HTTP, file by file, as before issue 24 (peers off).
FETCH_TORRENT = env_bool("LLMGW_FETCH_TORRENT", True)
# Where this node serves the verified pieces it holds to the fleet's other nodes (docs/fleet.md).
PEER_PORT = env_int("LLMGW_PEER_PORT", 6881, minimum=1)
# Engines may be told to run code shipped with the weights (vLLM's --trust-remote-code)
# only when this is set: the mirror is a place files are copied into by hand.
LLMGW_ALLOW_REMOTE_CODE = env_bool("LLMGW_ALLOW_REMOTE_CODE", False)
# Where engines listen, and the host the gateway reaches them by.
LLMGW_ENGINE_HOST = env_str("LLMGW_ENGINE_HOST", "127.0.0.1")
LLMGW_ENGINE_ADVERTISE = env_str("LLMGW_ENGINE_ADVERTISE", "")
# Engines run as this user when set (docs/agent.md, "Engines fenced"); empty: as the agent's own.
ENGINE_USER = env_str("LLMGW_ENGINE_USER", "")
# The node's /metrics (docs/observability.md).
AGENT_METRICS_ADDR = env_str("LLMGW_AGENT_METRICS_ADDR", "")
AGENT_METRICS_TOKEN = env_str("LLMGW_AGENT_METRICS_TOKEN", "")

# --- Celery: the node's worker (agent/celery.py) --------------------------------

# The broker and the log format, as every llmgw process has them.
from contracts.process_settings import *  # noqa: E402, F403

# This node's own Redis user (LLMGW_REDIS_ACL) and bookkeeping keys, where its name is known:
# `manage.py agent` sets them itself (agent.worker.use_own_broker) and LLMGW_NODE_NAME for the
# processes it starts, which make the same here from the node's name and token.
_node, _token = os.environ.get("LLMGW_NODE_NAME", "").strip(), os.environ.get("LLMGW_NODE_TOKEN", "").strip()
if _node:
    CELERY_BROKER_TRANSPORT_OPTIONS = {**CELERY_BROKER_TRANSPORT_OPTIONS, **unacked_keys(_node)}  # noqa: F405
    if REDIS_ACL and _token:  # noqa: F405
        REDIS_URL = CELERY_BROKER_URL = node_redis_url(REDIS_URL, _node, token_hash(_token))  # noqa: F405
