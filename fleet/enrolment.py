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
import threading
import time
from typing import NamedTuple

from django.db import connection
from django.utils import timezone

from common import audit
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
    node = Node.objects.filter(name=node_name).first()
    if node is None:
        return False
    Node.objects.filter(pk=node.pk).update(token_hash="", replica_key="")
    if node.token_hash:
        audit.record_update(node, {"token_hash": [audit.mask_secret(node.token_hash), ""]})
    return True


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


FACT_FIELDS = {
    "engines",
    "engines_unusable",
    "gpus",
    "memory_gb",
    "disk_free_bytes",
    "agent_version",
    "labels",
    "rpc",
    "rpc_head",
}


def record_heartbeat(name: str, facts: dict) -> str | None:
    """Update a node from its agent's facts, checked already (fleet.messages): its name, or None when it is gone.

    A thousand nodes beat every 15 s. The node is read with plain SQL (through the
    ORM, building the query costs ten times what the database does), and only the
    facts that differ are written, with the time of the beat, in one UPDATE.
    """
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT id, name, engines, engines_unusable, gpus, memory_gb, disk_free_bytes, agent_version, labels, rpc, rpc_head "
            f"FROM {Node._meta.db_table} WHERE name = %s",
            [name],
        )
        row = cursor.fetchone()
    claimed = facts.get("node")
    if row is None or (claimed is not None and claimed != row[1]):
        return None
    node_id, name, engines, engines_unusable, gpus, memory_gb, disk_free_bytes, agent_version, labels, rpc, rpc_head = (
        row
    )
    # JSON columns come back as text on both SQLite and PostgreSQL: Django decodes them itself.
    known = {
        "engines": json.loads(engines),
        "engines_unusable": json.loads(engines_unusable),
        "gpus": json.loads(gpus),
        "memory_gb": memory_gb,
        "disk_free_bytes": disk_free_bytes,
        "agent_version": agent_version,
        "labels": json.loads(labels),
        "rpc": bool(rpc),
        "rpc_head": bool(rpc_head),
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
        # Optional (issue 37): an agent older than the RPC build says nothing, and takes no part in a group.
        "rpc": facts.get("rpc") is True,
        "rpc_head": facts.get("rpc_head") is True,
    }
    if isinstance(facts.get("labels"), dict):
        reported["labels"] = {str(k): str(v) for k, v in facts["labels"].items()}
    changed = {field: value for field, value in reported.items() if known[field] != value}
    Node.objects.filter(pk=node_id).update(last_heartbeat=timezone.now(), **changed)
    return name


# --- the byte listener's view of the nodes: cached, so a pass check costs no query per client ---


class EnrolledNodes:
    """Nodes' token hashes (and addresses fixed at enrolment), read at most once per `ttl` seconds per name.

    The byte listener checks a pass on every request, and a connection per client to the
    database is what ran PostgreSQL out of connections (issue 33). So:
    - a node's hash is read once and believed for `ttl` seconds: a revoked token is refused
      within `ttl` seconds, not at once;
    - a pass that does not match the cached hash may be one of a token issued anew: the node
      is read again, but at most `rechecks` times a second per name, so wrong passes cost at
      most that many queries a second per node name, however many clients send them;
    - an unknown name is remembered as unknown for `ttl` too; the table holds at most `size`
      names, the oldest dropped first;
    - the tracker asks for every node it names at once: one query for those not cached.
    """

    def __init__(
        self, ttl: float, rechecks: int = 5, size: int = 10_000, readers: int = 4, close_after_read: bool = False
    ):
        self.ttl = ttl
        self.rechecks = rechecks
        self.size = size
        # name -> (token hash or "", address fixed at enrolment or "", monotonic time read)
        self._known: dict[str, tuple[str, str, float]] = {}
        # name -> (the second, whole seconds of the monotonic clock, and the re-reads asked in it)
        self._rechecked: dict[str, tuple[int, int]] = {}
        # At most this many reads at once (greenlets, under the byte listener's gevent), each on a
        # connection closed as soon as it is read when `close_after_read`: the database sees at
        # most `readers` connections from the pass check of one process, whatever the clients do.
        self._readers = threading.BoundedSemaphore(readers)
        self.close_after_read = close_after_read

    def _read(self, names: list[str]) -> None:
        with self._readers:
            # Another reader may have read them while this one waited.
            now = time.monotonic()
            names = [n for n in names if n not in self._known or now - self._known[n][2] >= self.ttl]
            if not names:
                return
            # Node.address is fixed at enrolment (`node_token --address`); empty where it was not given.
            fields = ["name", "token_hash", "address"]
            try:
                rows = {row[0]: row for row in Node.objects.filter(name__in=names).values_list(*fields)}
            finally:
                if self.close_after_read and not connection.in_atomic_block:
                    connection.close()
            now = time.monotonic()
            for name in names:
                row = rows.get(name)
                self._known.pop(name, None)  # put back last: the oldest are first in the dict
                self._known[name] = (row[1] or "", row[2] or "", now) if row else ("", "", now)
            while len(self._known) > self.size:
                self._known.pop(next(iter(self._known)))

    def many(self, names) -> dict[str, tuple[str, str]]:
        """{name: (token hash or "", enrolled address or "")} for these names; one query for those not fresh."""
        names = list(dict.fromkeys(names))
        now = time.monotonic()
        stale = [n for n in names if n not in self._known or now - self._known[n][2] >= self.ttl]
        if stale:
            self._read(stale)
        return {n: self._known[n][:2] for n in names if n in self._known}

    def token_hash_of(self, name: str) -> str | None:
        return self.many([name]).get(name, ("", ""))[0] or None

    def address_of(self, name: str) -> str:
        return self.many([name]).get(name, ("", ""))[1]

    def read_again(self, name: str) -> bool:
        """Forget `name` (a pass that did not match), unless it was re-read `rechecks` times this second; whether it did."""
        second = int(time.monotonic())
        then, count = self._rechecked.get(name, (second, 0))
        count = count + 1 if then == second else 1
        self._rechecked.pop(name, None)
        self._rechecked[name] = (second, count)
        while len(self._rechecked) > self.size:
            self._rechecked.pop(next(iter(self._rechecked)))
        if count > self.rechecks:
            return False
        self._known.pop(name, None)
        return True

    def clear(self) -> None:
        self._known.clear()
        self._rechecked.clear()
