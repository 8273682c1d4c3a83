"""Messages as a node's agent signs them (contracts.signing `sign_message`), for tests that play a node.

The key is the node's token hash, which the test reads from the database (the node
computes the same from its token); `token=` signs with another token's key instead,
as a forger who does not hold the node's token would have to.
"""

from __future__ import annotations

import json

from contracts import keys, signing, tasks
from fleet.models import Node


def node_key(name: str, token: str | None = None) -> str:
    return signing.token_hash(token) if token is not None else Node.objects.get(name=name).token_hash


def signed(
    name: str, kind: str, body: dict, *, token: str | None = None, now: float | None = None, seq: int | None = None
) -> dict:
    return signing.sign_message(node_key(name, token), kind, name, body, now=now, seq=seq)


def heartbeat(name: str, facts: dict, **how) -> dict:
    return signed(name, tasks.HEARTBEAT, {"node": name, **facts}, **how)


def report(name: str, replica_id: int, state: str, endpoint: str = "", reason: str = "", **how) -> dict:
    body = tasks.ReplicaReport(replica=replica_id, state=state, endpoint=endpoint, reason=reason)
    return signed(name, tasks.REPLICA_REPORT, dict(body), **how)


def fetch_report(name: str, body: dict, **how) -> dict:
    return signed(name, tasks.FETCH_FINISHED, body, **how)


def post_heartbeat(broker, name: str, message: dict | str) -> None:
    """Posted where the node's agent posts it, asking for a collection as it does."""
    from celery import current_app

    raw = message if isinstance(message, str) else json.dumps(message)
    tasks.post_heartbeat(broker, current_app.send_task, name, raw)


def post_report(broker, name: str, replica_id: int, message: dict | str) -> None:
    from celery import current_app

    raw = message if isinstance(message, str) else json.dumps(message)
    tasks.post_report(broker, current_app.send_task, name, replica_id, raw)


def node_keys(broker, *names: str) -> list[str]:
    return [key for name in names for key in (keys.heartbeat_key(name), keys.reports_key(name))]
