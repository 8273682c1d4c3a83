"""Enrolment tokens: what lets an agent speak for one node and no other.

A worker that can reach the broker can send any task; the token is what the
control plane believes. It is made in the admin (or by `make run` for this
host), shown once, and stored only as its hash.
"""

from __future__ import annotations

import hmac
import secrets

from django.utils import timezone

from contracts import signing

from .models import Node


def hash_token(token: str) -> str:
    # The same hash keys the proofs on the messages sent to the node (contracts.signing).
    return signing.token_hash(token)


def issue_token(node_name: str) -> str:
    """A new enrolment token for this node (created if new); any earlier token stops working."""
    token = "llmgw-node-" + secrets.token_urlsafe(32)
    node, _ = Node.objects.get_or_create(name=node_name)
    node.token_hash = hash_token(token)
    node.save(update_fields=["token_hash"])
    return token


def node_for_token(token: str, claimed_name: str | None = None) -> Node | None:
    """The node this token enrols, or None; also None when it claims to be another node."""
    if not token:
        return None
    digest = hash_token(token)
    node = Node.objects.filter(token_hash=digest).first()
    if node is None or not hmac.compare_digest(node.token_hash, digest):
        return None
    if claimed_name is not None and claimed_name != node.name:
        return None
    return node


FACT_FIELDS = {"engines", "gpus", "memory_gb", "disk_free_bytes", "agent_version", "labels"}


def record_heartbeat(token: str, facts: dict) -> Node | None:
    """Upsert a node from its agent's facts; None when the token does not enrol it."""
    node = node_for_token(token, claimed_name=facts.get("node"))
    if node is None:
        return None
    node.engines = [str(e) for e in facts.get("engines") or []]
    node.gpus = list(facts.get("gpus") or [])
    node.memory_gb = max(0, int(facts.get("memory_gb") or 0))
    node.disk_free_bytes = max(0, int(facts.get("disk_free_bytes") or 0))
    node.agent_version = str(facts.get("agent_version") or "")[:50]
    if isinstance(facts.get("labels"), dict):
        node.labels = {str(k): str(v) for k, v in facts["labels"].items()}
    node.last_heartbeat = timezone.now()
    node.save()
    return node
