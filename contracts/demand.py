"""What the gateway tells the control plane about load, and how it asks for a model to wake.

The gateway never writes to the database on a request's path. Each gateway process keeps
its counts in memory and, about once a second from a background thread (never from a
request), writes them as one field of the Redis hash LOAD_KEY: the field is the process's
own id, the value a JSON `Load`. The control plane's autoscaler reads the whole hash, drops
fields older than LOAD_STALE_S (a process that died), and sums the rest.

A request that finds no ready replica for a model that can have one waits in the gateway.
The first waiting request for a model asks the control plane to wake it: it sets
`wake_key(model)` with SET NX EX=WAKE_TTL_S (so the others do not ask again) and, only when
that SET succeeded, sends the control-plane task WAKE with the model's name. The waiting
count in the next load snapshot keeps the model awake after that.
"""

from __future__ import annotations

import json
from typing import TypedDict

LOAD_KEY = "llmgw:demand:load"
# A process's snapshot older than this is ignored (the process is gone or stuck).
LOAD_STALE_S = 10.0
# How often a gateway process writes its snapshot.
LOAD_INTERVAL_S = 1.0

# Where each gateway process started new conversations (gateway/conversations.py): a stream
# whose entries are {"from": the process's field of LOAD_KEY, "placed": "point:replica,..."},
# appended and read by the gateways only, with their load.
CONVERSATIONS_KEY = "llmgw:demand:conversations"

# wake(model: str): sent on the control queue by the gateway's first waiting request.
WAKE = "fleet.wake"
WAKE_TTL_S = 30


def wake_key(model: str) -> str:
    return f"llmgw:demand:wake:{model}"


class ModelLoad(TypedDict):
    in_flight: int  # requests being answered by a replica of this model right now
    waiting: int  # requests held because no replica of this model is ready
    last_request: float  # unix time of the last request that arrived for this model


class Load(TypedDict):
    at: float  # unix time the snapshot was taken
    models: dict[str, ModelLoad]
    # requests in flight per replica id (as a string: JSON keys), only replicas with any
    replicas: dict[str, int]


def encode(load: Load) -> str:
    return json.dumps(load, separators=(",", ":"))


def decode(raw: str | bytes) -> Load | None:
    """A snapshot, or None when the field is not one (never raises)."""
    try:
        value = json.loads(raw)
    except (TypeError, ValueError):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("at"), int | float):
        return None
    models = value.get("models")
    replicas = value.get("replicas")
    if not isinstance(models, dict) or not isinstance(replicas, dict):
        return None
    return value  # type: ignore[return-value]


def total(snapshots: list[Load], now: float) -> tuple[dict[str, ModelLoad], dict[int, int]]:
    """The fleet's load: fresh snapshots summed per model and per replica."""
    models: dict[str, ModelLoad] = {}
    replicas: dict[int, int] = {}
    for snap in snapshots:
        if now - snap["at"] > LOAD_STALE_S:
            continue
        for name, load in snap["models"].items():
            into = models.setdefault(name, {"in_flight": 0, "waiting": 0, "last_request": 0.0})
            into["in_flight"] += int(load.get("in_flight", 0))
            into["waiting"] += int(load.get("waiting", 0))
            into["last_request"] = max(into["last_request"], float(load.get("last_request", 0.0)))
        for replica_id, count in snap["replicas"].items():
            try:
                key = int(replica_id)
            except ValueError:
                continue
            replicas[key] = replicas.get(key, 0) + int(count)
    return models, replicas
