"""Tasks as the control plane sends them to a node, and what a node made of them."""

from __future__ import annotations

import base64
import json

from celery import current_app

from contracts import progress as contracts_progress
from contracts import signing
from fleet.models import Node


def send_fetch(node: str, source: str, broker_url: str | None = None) -> None:
    """A fetch as the control plane sends it: with its proof, for that node (on `broker_url`, else the test's Redis)."""
    key = Node.objects.get(name=node).token_hash
    kwargs = signing.with_proof(key, "agent.fetch", node, [source])
    if broker_url is None:
        current_app.send_task("agent.fetch", args=[source], kwargs=kwargs, queue=f"node.{node}")
        return
    with current_app.connection_for_write(broker_url) as connection:
        current_app.send_task("agent.fetch", args=[source], kwargs=kwargs, queue=f"node.{node}", connection=connection)


def live(redis_client, source: str, node: str) -> dict:
    """A node's live progress on fetching `source`, as the agent publishes it."""
    return contracts_progress.read_one(redis_client, node, source) or {}


def sent(broker, queue: str) -> list[tuple]:
    """Tasks waiting on a queue, oldest first, as (name, args) or (name, args, kwargs) when
    there are kwargs; taken off it, so the next look sees only new ones.

    Each must carry a proof the node it is for would accept; the proof is checked and left out.
    """
    messages = []
    node_name = queue.removeprefix("node.")
    key = Node.objects.get(name=node_name).token_hash
    while (raw := broker.rpop(queue)) is not None:
        message = json.loads(raw)
        task = message["headers"]["task"]
        args, kwargs, _ = json.loads(base64.b64decode(message["body"]))
        proof = kwargs.pop("proof", None)
        assert signing.proof_problem(key, task, node_name, args, kwargs, proof) is None, (task, args, kwargs)
        messages.append((task, args, kwargs) if kwargs else (task, args))
    return messages
