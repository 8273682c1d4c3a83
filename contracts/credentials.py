"""The two credentials a node never receives but derives: its engines' secrets and its byte-listener pass.

Both come from the sha256 of the node's enrolment token, the key that already signs
the tasks sent to the node (`contracts.signing`): the control plane stores exactly
that hash (`fleet.Node.token_hash`) and the node computes it from `LLMGW_NODE_TOKEN`.
So neither credential ever crosses the broker, which every node can read, and
re-enrolling a node (a new token) changes both.

- A replica's engine secret: what the gateway presents to the engine as
  `Authorization: Bearer …`, and what the engine is started with (in its
  environment, never its argv). It names the replica and a nonce the control plane
  sends in the start (the replica's creation time), so a replaced replica, even one
  that got a reused id, has a different secret. It is keyed by the node's replica
  key, an HMAC of the token hash (`fleet.Node.replica_key`), not by the token hash
  itself: the gateway, the host that parses untrusted clients' input, holds the
  replica keys and never a token hash, so a gateway taken over can call engines but
  cannot sign an order, a pass or a report for any node.
- A node's byte pass: `NODE:EXPIRES:MAC`, sent to the byte listener on every request.
  The listener finds the node's token hash by name and checks the MAC; a node whose
  token was revoked or re-issued fails at its next request. It expires, so a pass
  copied off the wire is worth little; a node makes a fresh one for every request.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from urllib.parse import quote, urlsplit, urlunsplit

from .names import node_name_problem

BYTES_PASS_TTL_S = 3600
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _mac(key: str, message: str) -> str:
    return hmac.new(key.encode(), message.encode(), hashlib.sha256).hexdigest()


# --- engines ------------------------------------------------------------------------


def replica_nonce(created: datetime) -> str:
    """The part of a replica's secret that a new replica of a reused id does not share: microseconds since 1970."""
    return str((created - EPOCH) // timedelta(microseconds=1))


def replica_key(key: str) -> str:
    """The key of a node's engine secrets, from its token hash `key`; what the gateway holds. Empty without a key.

    One way: the token hash, which signs the node's orders, cannot be found from it.
    """
    return _mac(key, "replicas") if key else ""


def replica_secret(key: str, replica_id: int, nonce: str) -> str:
    """The engine secret of one replica, as its node makes it: `key` is the node's token hash. Empty without a key."""
    return replica_secret_from_replica_key(replica_key(key), replica_id, nonce)


def replica_secret_from_replica_key(key: str, replica_id: int, nonce: str) -> str:
    """The same secret, as the gateway makes it: `key` is the node's replica key. Empty without a key."""
    if not key:
        return ""
    return "llmgw-replica-" + _mac(key, f"replica:{int(replica_id)}:{nonce}")


# --- the byte listener --------------------------------------------------------------


def bytes_pass(key: str, node: str, now: float | None = None) -> str:
    """A node's pass for the byte listener, good for BYTES_PASS_TTL_S; `key` is its token hash."""
    expires = int((time.time() if now is None else now) + BYTES_PASS_TTL_S)
    return f"{node}:{expires}:{_mac(key, f'bytes:{node}:{expires}')}"


def bytes_pass_problem(presented: str, key_of: Callable[[str], str | None], now: float | None = None) -> str | None:
    """Why this pass does not let its bearer read the mirror, or None when it does.

    `key_of(node)` is that node's token hash, or None (or "") when there is no such
    node or its token was revoked.
    """
    node, _, rest = presented.partition(":")
    expires, _, mac = rest.partition(":")
    if node_name_problem(node) or not expires.isdigit() or not mac:
        return "the credential is not a node's pass (NODE:EXPIRES:MAC)"
    key = key_of(node)
    if not key or not hmac.compare_digest(_mac(key, f"bytes:{node}:{expires}"), mac):
        return f"the credential is not one of node {node}'s current enrolment token (unknown node, or revoked)"
    now = time.time() if now is None else now
    if int(expires) < now:
        return f"the credential expired at {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(int(expires)))} UTC"
    if int(expires) > now + 2 * BYTES_PASS_TTL_S:
        return "the credential is good for longer than a node's pass may be: the node's clock is far ahead"
    return None


def bearer(secret: str) -> dict[str, str]:
    """The header that presents a secret; none for an empty one."""
    return {"Authorization": f"Bearer {secret}"} if secret else {}


# --- Redis (each principal its own user: fleet/redis_acl.py) ------------------------


def redis_user(node: str) -> str:
    """The node's Redis user."""
    return f"node-{node}"


def redis_password(key: str, node: str) -> str:
    """The node's Redis password; `key` is its token hash. The ACL holds only its sha256."""
    return "llmgw-redis-" + _mac(key, f"redis:{node}")


def node_redis_url(url: str, node: str, key: str) -> str:
    """`url` as node `node` connects: its user, and its password made from `key` (its token hash)."""
    return redis_url_as(url, redis_user(node), redis_password(key, node))


def redis_url_as(url: str, user: str, password: str) -> str:
    """`url` (redis://[user:password@]host:port/db) with this user and password instead of its own."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{quote(user, safe='')}:{quote(password, safe='')}@{host}"))


def redis_url_shown(url: str) -> str:
    """`url` as it may be printed or logged: its password left out."""
    parts = urlsplit(url)
    user, _, host = parts.netloc.rpartition("@")
    if not user:
        return url
    name = user.partition(":")[0]
    return urlunsplit(parts._replace(netloc=f"{name}:***@{host}" if name else f":***@{host}"))
