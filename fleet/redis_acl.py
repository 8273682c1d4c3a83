"""Each principal its own Redis user (issue 33): the ACL rules of the control plane, the gateways,
the byte listener and every node, as Redis 7 reads them from its `aclfile`.

A node reaches its own keys (`llmgw:node:NAME:*`, contracts.keys), its own queue and its
bookkeeping of it, and pushes onto the control queue; nothing of another node's, no
MONITOR, KEYS, SCAN, CONFIG, FLUSH*, no channel (pidbox, events). A gateway reaches the
limit, demand and usage keys and wakes the fleet through the control queue; the byte
listener its tracker's keys. The control plane reaches every key but no admin command
beyond managing the nodes' users; the scheduler's lease and schedule (`llmgw:beat:*`,
celery-redbeat: SET NX PX, sorted sets and a Lua script) are among them. `user default off`: a client that names no user
is refused.

What each principal issues was found by running it against a Redis with this file and
reading `ACL LOG` (tests/test_redis_acl.py keeps it so).

Passwords: a node's is made from its token hash (contracts.credentials.redis_password),
so enrolment hands it nothing more than its token. The control plane's, the byte
listener's and each gateway's are made from Django's SECRET_KEY on the control plane:
`manage.py redis_acl --url USER` prints the REDIS_URL to give that process. The file
holds only their sha256.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

import redis
from django.conf import settings

from contracts import credentials, keys
from contracts.tasks import COLLECT_PENDING_KEY, node_queue

from .models import Node

CONTROL_USER = "llmgw-control"
BYTES_USER = "llmgw-bytes"
GATEWAY_PREFIX = "gateway-"
CONTROL_QUEUE = "control"

# What no principal but the operator needs: keyless reads of the whole keyspace, the
# admin commands, the channels (Celery's pidbox and events live there), script control.
_NEVER = "-@dangerous -@pubsub -scan -randomkey -dbsize -script|flush -script|kill -function|flush -function|kill"
# Data commands on the user's own keys; the key patterns decide which.
_DATA = f"resetchannels -@all +@read +@write +@transaction +@connection +@scripting {_NEVER}"
# Telling the control plane something: a task pushed onto its queue, after kombu reads the queue's binding.
_TO_CONTROL = (
    f"(~{CONTROL_QUEUE} resetchannels -@all +lpush) (~_kombu.binding.{CONTROL_QUEUE} resetchannels -@all +smembers)"
)


def _hashed(password: str) -> str:
    return "#" + hashlib.sha256(password.encode()).hexdigest()


def gateway_user(name: str) -> str:
    return GATEWAY_PREFIX + name


def principal_password(user: str) -> str:
    """The Redis password of a control-plane-side principal (control, bytes, a gateway), made from SECRET_KEY."""
    return "llmgw-redis-" + hmac.new(settings.SECRET_KEY.encode(), f"redis:{user}".encode(), hashlib.sha256).hexdigest()


def node_rules(name: str, password: str) -> str:
    """The ACL rules of node NAME's user (without `user NAME`): its keys, its queue, a push onto control."""
    queue = node_queue(name)
    own = [keys.node_prefix(name) + "*", queue, f"_kombu.binding.{queue}", *keys.unacked_keys(name).values()]
    patterns = " ".join("~" + pattern for pattern in own)
    # Read only: the byte listener's records (a version's manifest and torrent, who holds it), which a
    # node fetches by when the byte listener's host is gone (issue 38; agent/sources.py, agent/peers.py).
    patterns += " " + " ".join("%R~" + pattern for pattern in BYTES_KEYS)
    # The collect hint is the one shared key a node may set (KEYS.md): SET NX EX, a hint only.
    hint = f"(~{COLLECT_PENDING_KEY} resetchannels -@all +set)"
    return f"on {_hashed(password)} resetkeys {patterns} {_DATA} {_TO_CONTROL} {hint}"


def control_rules(password: str) -> str:
    """Every key, every data command; of the admin commands only what enrolment needs: a node's user made or changed."""
    manage_users = "+acl|setuser +acl|deluser +acl|getuser +acl|save +acl|whoami +info"
    return f"on {_hashed(password)} resetkeys ~* resetchannels +@all {_NEVER} {manage_users}"


GATEWAY_KEYS = (
    "llmgw:limit:*",  # gateway/limits.py: the keys' counters, shared by every gateway
    "llmgw:demand:*",  # contracts/demand.py: the load each gateway sees, the wake-ups
    "llmgw:usage-hour:*",  # gateway/metrics.py
    "llmgw:routes-hour:*",  # fleet/routing.py, counted by the gateway
    "llmgw:replica-recent:*",
)
# Read only: a replica's fetch on the error page of a model that is not ready (gateway/prospects.py).
GATEWAY_READS = ("llmgw:node:*:progress", "llmgw:node:*:engine-stats", "llmgw:control-listening")


def gateway_rules(password: str) -> str:
    patterns = " ".join("~" + p for p in GATEWAY_KEYS) + " " + " ".join("%R~" + p for p in GATEWAY_READS)
    return f"on {_hashed(password)} resetkeys {patterns} {_DATA} {_TO_CONTROL}"


BYTES_KEYS = ("llmgw:swarm*",)  # mirror/tracker.py: the tracker's peer records


def bytes_rules(password: str) -> str:
    patterns = " ".join("~" + p for p in BYTES_KEYS)
    return f"on {_hashed(password)} resetkeys {patterns} {_DATA}"


def acl_file(gateways: list[str]) -> str:
    """The whole ACL file: the default user off, the control plane, the byte listener, the gateways, every enrolled node."""
    # Redis reads no comment in an ACL file: every line is a user.
    lines = [
        "user default off resetkeys resetchannels -@all",
        f"user {CONTROL_USER} {control_rules(principal_password(CONTROL_USER))}",
        f"user {BYTES_USER} {bytes_rules(principal_password(BYTES_USER))}",
    ]
    for name in sorted(set(gateways)):
        lines.append(f"user {gateway_user(name)} {gateway_rules(principal_password(gateway_user(name)))}")
    for name, token_hash in Node.objects.exclude(token_hash="").order_by("name").values_list("name", "token_hash"):
        lines.append(
            f"user {credentials.redis_user(name)} {node_rules(name, credentials.redis_password(token_hash, name))}"
        )
    return "\n".join(lines) + "\n"


def write_acl_file(path: Path, gateways: list[str]) -> None:
    """The ACL file at `path`, made with mode 0600 whatever the umask, and put in place whole.

    Created with its mode rather than chmod-ed after: between a write and a chmod, any user
    of the host could open it, and an open file stays readable after the chmod.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(acl_file(gateways))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def url_for(user: str) -> str:
    """REDIS_URL for this control-plane-side principal: the control plane's own, with its user and password."""
    return credentials.redis_url_as(settings.REDIS_URL, user, principal_password(user))


def apply_node(client, name: str, token_hash: str) -> str | None:
    """Make or change node NAME's user on a running Redis, and save the ACL file; a sentence when it cannot.

    A revoked node (no token hash) loses its user. Where the control plane's user may not
    (a Redis with one password, or an operator who keeps the ACL file by hand), the sentence
    says what to do instead.
    """
    user = credentials.redis_user(name)
    try:
        if token_hash:
            rules = node_rules(name, credentials.redis_password(token_hash, name))
            client.execute_command("ACL", "SETUSER", user, "reset", *_split(rules))
        else:
            client.execute_command("ACL", "DELUSER", user)
    except redis.RedisError as error:
        return (
            f"node {name}'s Redis user was not changed ({error}): run `(umask 077; manage.py redis_acl --gateway NAME "
            "> /etc/redis/users.acl)`, naming every gateway, and restart Redis, which reads that aclfile as it starts"
        )
    try:
        client.execute_command("ACL", "SAVE")
    except redis.RedisError as error:
        return f"node {name}'s Redis user is set but not saved to an ACL file ({error}): it is lost when Redis restarts"
    return None


def _split(rules: str) -> list[str]:
    """ACL SETUSER takes each rule as an argument, a selector `(...)` as one."""
    out, depth, current = [], 0, []
    for word in rules.split(" "):
        if word.startswith("("):
            depth += 1
        if depth:
            current.append(word)
            if word.endswith(")"):
                depth -= 1
                out.append(" ".join(current))
                current = []
        elif word:
            out.append(word)
    return out
