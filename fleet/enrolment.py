"""Enrolment tokens: what lets an agent speak for one node and no other.

A worker that can reach the broker can send any task; what the control plane believes
is a message signed with the node's key, the hash of its token (contracts.signing).
The token is made in the admin (or by `make run` for this host), shown once, and stored
only as its hash; it never crosses the broker. Enrolment also fixes the node's address:
where its engines may be, whatever it reports (fleet.reports.endpoint_problem).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import re
import secrets
from typing import NamedTuple

from django.db import connection
from django.utils import timezone

from contracts import signing

from .models import Node


def hash_token(token: str) -> str:
    # The same hash keys the proofs on the messages sent to the node (contracts.signing).
    return signing.token_hash(token)


_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def address_problem(address: str) -> str | None:
    """Why this cannot be a node's enrolled address (an IP address or a host name), or None."""
    if not address:
        return None
    try:
        ipaddress.ip_address(address)
        return None
    except ValueError:
        pass
    if len(address) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in address.split(".")):
        return f"{address[:100]!r} is neither an IP address nor a host name"
    return None


def issue_token(node_name: str, address: str | None = None) -> str:
    """A new enrolment token for this node (created if new); any earlier token stops working.

    `address` is where its engines answer (None: unchanged; "": loopback only). Raises
    ValueError with a sentence for an address that is neither an IP address nor a host name.
    """
    if address is not None and (problem := address_problem(address)):
        raise ValueError(problem)
    token = "llmgw-node-" + secrets.token_urlsafe(32)
    node, _ = Node.objects.get_or_create(name=node_name)
    node.token_hash = hash_token(token)
    fields = ["token_hash"]
    if address is not None:
        node.address = address
        fields.append("address")
    node.save(update_fields=fields)  # and its replica key with it (Node.save)
    return token


class Enrolled(NamedTuple):
    """What the control plane needs of a node to believe its messages."""

    id: int
    name: str
    key: str  # the token hash: the key of its signatures
    address: str

    def as_node(self) -> Node:
        # Enough of a Node for recording reports and fetches against it, without another query.
        return Node(pk=self.id, name=self.name, token_hash=self.key, address=self.address)


def enrolled() -> dict[str, Enrolled]:
    """Every node with a token, by name: those whose posted heartbeats and reports are collected."""
    rows = Node.objects.exclude(token_hash="").values_list("id", "name", "token_hash", "address")
    return {row[1]: Enrolled(*row) for row in rows}


def enrolled_node(name) -> Enrolled | None:
    """The node of this name, when it has a token; None for anything else (a name is what a message claims)."""
    if not isinstance(name, str) or not name:
        return None
    rows = Node.objects.filter(name=name).exclude(token_hash="").values_list("id", "name", "token_hash", "address")
    row = rows.first()
    return Enrolled(*row) if row else None


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


def record_heartbeat(name: str, facts: dict) -> str | None:
    """Update a node from its agent's facts, checked already (fleet.messages): its name, or None when it is gone.

    A thousand nodes beat every 15 s. The node is read with plain SQL (through the
    ORM, building the query costs ten times what the database does), and only the
    facts that differ are written, with the time of the beat, in one UPDATE.
    """
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT id, name, engines, engines_unusable, gpus, memory_gb, disk_free_bytes, agent_version, labels "
            f"FROM {Node._meta.db_table} WHERE name = %s",
            [name],
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
