"""What the gateway routes by: a snapshot of models, ready replicas and keys, read from the database.

The gateway never touches the database while it forwards a request. A thread
reads this snapshot every LLMGW_GATEWAY_REFRESH_MS and the event loop swaps it
in whole, so a request sees one consistent table and pays nothing for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import redis

from catalog.models import Model, Profile
from contracts import progress
from fleet.live import redis_client
from fleet.models import Replica

from .models import ApiKey


@dataclass(frozen=True)
class Upstream:
    replica_id: int
    base: str  # the engine's OpenAI base URL, ending in /v1
    weight: int


@dataclass(frozen=True)
class Route:
    name: str
    aliases: tuple[str, ...]
    context_length: int
    max_output: int  # 0: no limit of its own
    created: int
    upstreams: tuple[Upstream, ...]


@dataclass(frozen=True)
class Key:
    id: int
    name: str
    models: frozenset[str] | None  # None: every model

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models


@dataclass
class Table:
    routes: dict[str, Route] = field(default_factory=dict)  # by name and by alias
    models: list[Route] = field(default_factory=list)  # each once, in name order
    keys: dict[str, Key] = field(default_factory=dict)  # by sha256 of the key


def load() -> Table:
    """The current table. Runs in a thread: it reads the database."""
    weights = {(p.model_id, p.name): max(p.weight, 0) for p in Profile.objects.all()}
    ready: dict[str, list[Replica]] = {}
    for replica in Replica.objects.filter(state=Replica.State.READY).exclude(endpoint=""):
        ready.setdefault(replica.model_name, []).append(replica)
    table = Table()
    for model in Model.objects.all():
        upstreams = tuple(
            Upstream(r.pk, r.endpoint.rstrip("/"), weights.get((model.pk, r.profile_name), 1))
            for r in ready.get(model.name, [])
        )
        aliases = tuple(a for a in (model.aliases or []) if isinstance(a, str))
        route = Route(
            name=model.name,
            aliases=aliases,
            context_length=model.context_length,
            max_output=model.max_output,
            created=int(model.added_at.timestamp()),
            upstreams=upstreams,
        )
        table.models.append(route)
        for alias in aliases:
            table.routes.setdefault(alias, route)
        table.routes[model.name] = route
    for key in ApiKey.objects.filter(active=True):
        allowed = frozenset(key.model_names) if key.model_names else None
        table.keys[key.key_hash] = Key(key.pk, key.name, allowed)
    return table


def why_not_ready(model_name: str) -> str:
    """Why no replica of this model can answer now, in a sentence. Runs in a thread."""
    replicas = list(Replica.objects.filter(model_name=model_name).select_related("node"))
    if not replicas:
        return f"No replica of {model_name} is placed yet; placement runs every few seconds."
    said = []
    for replica in replicas:
        where = f" on {replica.node.name}" if replica.node_id else ""
        state = replica.state
        if state == Replica.State.FETCHING:
            state = f"fetching {fetched_percent(replica)}"
        elif state == Replica.State.READY:
            state = "ready, not yet routed"
        elif replica.reason:
            state = f"{state}: {replica.reason.rstrip('.')}"
        said.append(f"replica {replica.pk}{where} is {state}")
    return f"No replica of {model_name} is ready: " + "; ".join(said) + "."


def fetched_percent(replica: Replica) -> str:
    """How far the replica's node is with its weights, from the agent's progress in Redis."""
    try:
        snapshot = progress.read(redis_client(), replica.source).get(replica.node.name if replica.node_id else "")
    except redis.RedisError:  # progress is a courtesy here; Redis away must not turn a 503 into a 500
        snapshot = None
    if not snapshot or not snapshot.get("bytes_total"):
        return "(progress not reported yet)"
    return f"{progress.percent(snapshot):.0f}%"
