"""The proof that a task on a node's queue was sent by the control plane, for that node.

Redis is reachable by every node, so a message is not trusted for being on a queue:
anyone who can reach the broker could put `agent.start_replica` on any node's queue.
Each task the control plane sends a node carries a `proof` keyword: an HMAC-SHA256 of
the task's name, its arguments, the node it is for and when it expires, keyed by the
sha256 of that node's enrolment token. The control plane stores exactly that hash
(`fleet.Node.token_hash`) and the node can compute it from its token, so both sides
hold the key and no other node does: a node cannot forge a message for another.

The expiry bounds a replay: a message copied off the queue is worth nothing after
`PROOF_TTL_S`. It is long enough for a task that waits in the queue while its node
restarts, or that the node takes back after its worker died.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time

PROOF_TTL_S = 3600
PROOF = "proof"


def token_hash(token: str) -> str:
    """What the control plane stores of a node's enrolment token, and the key of its messages."""
    return hashlib.sha256(token.encode()).hexdigest()


def _mac(key: str, task: str, node: str, args: list, kwargs: dict, expires: int) -> str:
    # Canonical JSON: the same bytes on both sides after the message's own JSON round trip.
    signed = json.dumps(
        {"task": task, "node": node, "args": list(args), "kwargs": kwargs, "expires": expires},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=True,
    )
    return hmac.new(key.encode(), signed.encode(), hashlib.sha256).hexdigest()


def sign(key: str, task: str, node: str, args: list, kwargs: dict | None = None, now: float | None = None) -> dict:
    """The proof to send as the task's `proof` keyword; `key` is the node's token hash."""
    expires = int((time.time() if now is None else now) + PROOF_TTL_S)
    return {"expires": expires, "mac": _mac(key, task, node, args, dict(kwargs or {}), expires)}


def proof_problem(
    key: str, task: str, node: str, args: list, kwargs: dict | None, proof, now: float | None = None
) -> str | None:
    """Why this message is not one the control plane sent this node, or None when it is."""
    if not isinstance(proof, dict):
        return "it carries no proof that the control plane sent it"
    expires, mac = proof.get("expires"), proof.get("mac")
    if not isinstance(expires, int) or isinstance(expires, bool) or not isinstance(mac, str):
        return "its proof is malformed"
    if not key:
        return "this node has no enrolment token to check it with"
    try:
        expected = _mac(key, task, node, args, dict(kwargs or {}), expires)
    except (TypeError, ValueError):
        return "its arguments cannot be checked"
    if not hmac.compare_digest(expected, mac):
        return "its proof does not match: it was not sent by the control plane for this node with these arguments"
    if (time.time() if now is None else now) > expires:
        return f"its proof expired at {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(expires))} UTC"
    return None


def with_proof(key: str, task: str, node: str, args: list, kwargs: dict | None = None) -> dict:
    """The keyword arguments to send: the task's own and its proof."""
    kwargs = dict(kwargs or {})
    return {**kwargs, PROOF: sign(key, task, node, args, kwargs)}
