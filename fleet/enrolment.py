"""Enrolment tokens: what lets an agent speak for one node and no other.

A worker that can reach the broker can send any task; the token is what the
control plane believes. It is made in the admin (or by `make run` for this
host), shown once, and stored only as its hash.
"""

from __future__ import annotations

import hmac
import json
import secrets

from django.db import connection
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
    node.save(update_fields=["token_hash"])  # and its replica key with it (Node.save)
    return token


def revoke_token(node_name: str) -> bool:
    """Turn a node's token off: its reports, the tasks signed for it and its byte-listener pass stop working.

    False when there is no such node.
    """
    return Node.objects.filter(name=node_name).update(token_hash="", replica_key="") == 1


def token_hash_of(node_name: str) -> str | None:
    """The node's current token hash, which keys its byte-listener pass; None or "" when there is none.

    Read on every request to the byte listener, so a revoked token stops a fetch at its next request.
    """
    return Node.objects.filter(name=node_name).values_list("token_hash", flat=True).first()


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


FACT_FIELDS = {"engines", "engines_unusable", "gpus", "memory_gb", "disk_free_bytes", "agent_version", "labels"}


def record_heartbeat(token: str, facts: dict) -> str | None:
    """Update a node from its agent's facts: the node's name, or None when the token does not enrol it.

    A thousand nodes beat every 15 s. The node is read with plain SQL (through the
    ORM, building the query costs ten times what the database does), and only the
    facts that differ are written, with the time of the beat, in one UPDATE.
    """
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT id, name, engines, engines_unusable, gpus, memory_gb, disk_free_bytes, agent_version, labels "
            f"FROM {Node._meta.db_table} WHERE token_hash = %s",
            [hash_token(token)],
        )
        row = cursor.fetchone()
    claimed = facts.get("node")
    if row is None or (claimed is not None and claimed != row[1]):
        return None
    node_id, name, engines, engines_unusable, gpus, memory_gb, disk_free_bytes, agent_version, labels = row
    # JSON columns come back as text on both SQLite and PostgreSQL: Django decodes them itself.
    known = {
        "engines": json.loads(engines),
        "engines_unusable": json.loads(engines_unusable),
        "gpus": json.loads(gpus),
        "memory_gb": memory_gb,
        "disk_free_bytes": disk_free_bytes,
        "agent_version": agent_version,
        "labels": json.loads(labels),
    }
    unusable = facts.get("engines_unusable")
    reported = {
        "engines": [str(e) for e in facts.get("engines") or []],
        # An engine installed but failing its self-test, and why: {engine: sentence}.
        "engines_unusable": {str(k): str(v)[:1000] for k, v in unusable.items()} if isinstance(unusable, dict) else {},
        "gpus": list(facts.get("gpus") or []),
        "memory_gb": max(0, int(facts.get("memory_gb") or 0)),
        "disk_free_bytes": max(0, int(facts.get("disk_free_bytes") or 0)),
        "agent_version": str(facts.get("agent_version") or "")[:50],
    }
    if isinstance(facts.get("labels"), dict):
        reported["labels"] = {str(k): str(v) for k, v in facts["labels"].items()}
    changed = {field: value for field, value in reported.items() if known[field] != value}
    Node.objects.filter(pk=node_id).update(last_heartbeat=timezone.now(), **changed)
    return name
