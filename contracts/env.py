"""Small typed readers for settings that come from the environment.

A wrong value stops the process at start with a sentence naming the variable,
rather than surfacing later as a traceback deep inside whatever used it. Both
settings modules read with them: the control plane's (`llmgw_site.settings`) and
the node's (`agent.settings`), so a variable is read the same way on either side.
"""

import os
from pathlib import Path


class SettingError(ValueError):
    """A setting whose value cannot be used; its message is the sentence to say."""


def env_str(name: str, default: str) -> str:
    value = os.environ.get(name, "").strip()
    return value or default


def env_int(name: str, default: int, minimum: int = 0) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SettingError(f"{name} must be a whole number, not {raw!r}") from None
    if value < minimum:
        raise SettingError(f"{name} must be at least {minimum}, not {value}")
    return value


def env_float(name: str, default: float, minimum: float = 0.0) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SettingError(f"{name} must be a number, like {default}, not {raw!r}") from None
    if not value >= minimum:  # NaN too
        raise SettingError(f"{name} must be at least {minimum:g}, not {raw}")
    return value


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in {"1", "true", "yes", "on"}:
        return True
    if raw in {"0", "false", "no", "off"}:
        return False
    raise SettingError(f"{name} must be true or false, not {raw!r}")


def env_path(name: str, default: Path, base: Path) -> Path:
    raw = os.environ.get(name, "").strip()
    path = Path(raw) if raw else default
    if not path.is_absolute():
        path = base / path
    return path


def env_addr(name: str, default: str) -> tuple[str, int]:
    """A listening address written HOST:PORT."""
    raw = env_str(name, default)
    host, sep, port = raw.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise SettingError(f"{name} must be written HOST:PORT, like 127.0.0.1:8001, not {raw!r}")
    return host, int(port)


# Every variable a node reads: agent.settings's, and the few the agent reads itself (its
# name, the engine self-test's patience). A node's environment is these (deploy/env/node.env
# sets the ones an operator must) and nothing of the control plane's; `make run` hands its
# agent these and no others. tests/test_layers.py keeps the list and the agent in step.
NODE_VARIABLES = (
    "LLMGW_NODE_TOKEN",
    "LLMGW_NODE_NAME",
    "REDIS_URL",
    "LLMGW_REDIS_ACL",
    "LLMGW_BYTES_URL",
    "LLMGW_BYTES_ADDR",
    "LLMGW_VAR",
    "LLMGW_AGENT_CACHE",
    "LLMGW_HEARTBEAT_S",
    "LLMGW_AGENT_REPROBE_S",
    "LLMGW_FETCH_PARALLEL",
    "LLMGW_FETCH_WAIT_S",
    "LLMGW_FETCH_CONNECTIONS",
    "LLMGW_FETCH_STALL_BYTES_S",
    "LLMGW_FETCH_STALL_S",
    "LLMGW_PEER_PORT",
    "LLMGW_FETCH_TORRENT",
    "LLMGW_LLAMA_SERVER",
    "LLMGW_ALLOW_REMOTE_CODE",
    "LLMGW_ENGINE_HOST",
    "LLMGW_ENGINE_ADVERTISE",
    "LLMGW_ENGINE_USER",
    "LLMGW_AGENT_METRICS_ADDR",
    "LLMGW_AGENT_METRICS_TOKEN",
    "LLMGW_VISIBILITY_TIMEOUT_S",
    "LLMGW_LOG_LEVEL",
    "LLMGW_SELFTEST_TIMEOUT_S",
    "LLMGW_NODE_CACHE_MAX_GB",
    "LLMGW_NODE_CACHE_FREE_GB",
    "LLMGW_RPC_SERVER",
    "LLMGW_STUNNEL",
    "LLMGW_RAY",
)
