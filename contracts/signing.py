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

What a node says goes the other way, signed by the node with the same key
(`sign_message`, `message_problem`): its heartbeats, replica reports and fetch reports
name the node and carry a MAC, never the token, so reading the broker gives nobody a
node's token. They expire after `REPORT_TTL_S` (minutes, not the orders' hour: see there)
and carry a sequence number that is the time they were signed, in microseconds, so the
control plane can bound it by its own clock.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time

PROOF_TTL_S = 3600
PROOF = "proof"

# A node's message is worth nothing after this long. A heartbeat and a repeated report are
# taken within a second or two of being posted, and the node says them again every 15 s and
# every minute, so an expired one is never missed; five minutes covers a control worker's
# restart for the reports that are said once (a state change, a fetch's end). Short, because
# a copy read off the broker can be posted again until then: a replayed replica report is
# refused by its sequence anyway, but a replayed heartbeat keeps a node that died looking
# alive, so at most this long (an hour, as for orders, would be an hour of a dead node).
REPORT_TTL_S = 300
# How far ahead of the control plane's clock a node's may be (the hosts run NTP): a message
# signed later than this, or expiring later than REPORT_TTL_S from now plus this, is refused.
CLOCK_SKEW_S = 60
_last_seq = 0


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


def sign_message(key: str, kind: str, node: str, body, now: float | None = None, seq: int | None = None) -> dict:
    """A node's message to the control plane, signed with its key (the token hash): sent or posted as is.

    `kind` is the task name it goes by (contracts/tasks.py); `seq` is when it was signed, in
    microseconds, and rises within a process even when two messages share a microsecond
    (given, it is a test playing a node that numbers its messages as it likes).
    """
    global _last_seq
    now = time.time() if now is None else now
    if seq is None:
        seq = _last_seq = max(int(now * 1_000_000), _last_seq + 1)
    expires = int(now) + REPORT_TTL_S
    return {
        "node": node,
        "kind": kind,
        "seq": seq,
        "expires": expires,
        "body": body,
        "mac": _mac(key, kind, node, [seq, body], {}, expires),
    }


def message_problem(key: str, kind: str, node: str, message, now: float | None = None) -> str | None:
    """Why this is not a message node `node` signed as `kind` and could have sent by now; None when it is.

    `key` is the node's token hash as the control plane stores it.
    """
    if not isinstance(message, dict):
        return "it is not a signed message (an agent older than the control plane sends its raw token instead)"
    if message.get("node") != node:
        return f"it names another node than {node}"
    if message.get("kind") != kind:
        return f"it is signed as {str(message.get('kind'))[:50]!r}, not {kind}"
    seq, expires, mac = message.get("seq"), message.get("expires"), message.get("mac")
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in (seq, expires)) or not isinstance(mac, str):
        return "its signature is malformed"
    if not key:
        return f"node {node} has no enrolment token to check it with"
    try:
        expected = _mac(key, kind, node, [seq, message.get("body")], {}, expires)
    except (TypeError, ValueError, RecursionError):
        return "its body cannot be checked"
    if not hmac.compare_digest(expected, mac):
        return f"its signature does not match: node {node} did not sign it"
    now = time.time() if now is None else now
    if now > expires:
        return f"it expired at {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(expires))} UTC"
    if expires > now + REPORT_TTL_S + CLOCK_SKEW_S:
        return f"it expires {expires - now:.0f} s from now, later than a node signs for ({REPORT_TTL_S} s)"
    # The sequence orders a replica's reports: one from the future would make every genuine
    # later report look old, so it may not be later than what the node could have signed by now.
    if not 0 < seq <= (now + CLOCK_SKEW_S) * 1_000_000:
        return f"its sequence number {seq} is not a time the node could have signed it at"
    return None
