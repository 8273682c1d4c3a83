"""Rows and request bodies as tests want them, with defaults a test overrides by name."""

from __future__ import annotations

from django.utils import timezone

from catalog.models import Model, Profile
from contracts import signing
from fleet.models import Node, Replica


def add_model(
    name="chat", aliases=(), context_length=1024, max_output=0, profiles=(("cpu", 1),), routing="chat"
) -> Model:
    """A catalog model whose profiles (name, weight) run on llamacpp; `routing` is its routing profile."""
    model = Model.objects.create(
        name=name,
        aliases=list(aliases),
        source=f"http://127.0.0.1:1/{name}/v1/",
        context_length=context_length,
        max_output=max_output,
        routing_profile=routing,
    )
    for profile, weight in profiles:
        Profile.objects.create(model=model, name=profile, engine="llamacpp", weight=weight)
    return model


def add_replica(
    model: str = "chat",
    endpoint: str = "http://127.0.0.1:9/v1",
    state="ready",
    profile="cpu",
    reason="",
    source="",
) -> Replica:
    """A replica of `model` on node n1 (made if missing)."""
    node, _ = Node.objects.get_or_create(name="n1")
    return Replica.objects.create(
        model_name=model, profile_name=profile, node=node, state=state, endpoint=endpoint, reason=reason, source=source
    )


def add_node(name: str, memory_gb: int = 32, **kw) -> Node:
    """A node that heartbeated just now, runs llamacpp, and holds the token `token-of-NAME`."""
    return Node.objects.create(
        name=name,
        engines=["llamacpp"],
        memory_gb=memory_gb,
        last_heartbeat=timezone.now(),
        token_hash=signing.token_hash(f"token-of-{name}"),
        **kw,
    )


def add_served_model(name: str, memory_gb: int = 0, source: str = "http://127.0.0.1:8001/tiny/v1/", **scaling) -> Model:
    """A model with one llamacpp profile `cpu` asking `memory_gb`, its scaling fields as given."""
    model = Model.objects.create(name=name, source=source, context_length=512, **scaling)
    Profile.objects.create(model=model, name="cpu", engine="llamacpp", min_memory_gb=memory_gb)
    return model


def new_model(**fields) -> dict:
    """The body of a POST to the catalog API for model `m`, with `fields` over it."""
    return {
        "name": "m",
        "source": "http://127.0.0.1:8001/m/v/",
        "context_length": 1024,
        "profiles": [{"name": "cpu", "engine": "llamacpp"}],
        **fields,
    }
