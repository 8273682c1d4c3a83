"""The messages between the control plane and the nodes: queues, task names, arguments.

Every message travels through Celery by name, so the name and the arguments are the
whole contract. A node's queue is `node.NAME`; the control plane's is `control`.
Names are never renamed: an agent of the last release may still be sending them.
"""

from __future__ import annotations

from typing import NotRequired, TypedDict

from . import keys, signing

CONTROL_QUEUE = "control"


def node_queue(node: str) -> str:
    return f"node.{node}"


# --- sent to a node, on its own queue --------------------------------------------------

# fetch(source: str): fetch a mirror address into the node's cache; task_id is set by the
# sender so that a cancel can revoke it before it starts.
FETCH = "agent.fetch"
# start_replica(replica_id: int, source: str, engine: str, args: list[str], model: str = ""):
# fetch the weights and run them with the engine, serving under the catalog name `model`.
START_REPLICA = "agent.start_replica"
# stop_replica(replica_id: int): stop that replica's engine; a node that runs no such
# replica answers `stopped` so the control plane can let the row go.
STOP_REPLICA = "agent.stop_replica"

# --- sent by a node, on the control queue ------------------------------------------------
#
# Each takes one argument: a message the node signed (contracts/signing.py `sign_message`:
# {node, kind, seq, expires, body, mac}), whose `kind` is the task's name. It names the node
# and never carries its token; the control plane checks it with the node's stored token
# hash. Until issue 33 the first argument was the node's raw enrolment token: a message in
# that form is refused with a log line (agents are upgraded before the control plane).

# heartbeat(message): body is Facts
HEARTBEAT = "fleet.heartbeat"
# fetch_finished(message): body is FetchReport
FETCH_FINISHED = "agent.fetch_finished"
# replica_report(message): body is ReplicaReport. The message's `seq` (when it was signed, in
# microseconds) orders a replica's reports: the control plane ignores one older than a
# report it applied, and refuses one signed later than its own clock allows.
REPLICA_REPORT = "fleet.replica_report"

# --- the control plane to itself ---------------------------------------------------------

RECONCILE = "fleet.reconcile"

# What a node reports of a replica it runs.
REPLICA_STATES = ("fetching", "starting", "ready", "failed", "stopped")
# How a fetch can end.
FETCH_ENDINGS = ("complete", "failed", "cancelled")


class Facts(TypedDict, total=False):
    """What a node says about itself on every heartbeat."""

    node: str
    agent_version: str
    engines: list[str]  # installed and passed the agent's self-test
    # Installed but failed the self-test: {engine: the sentence why}. Never in `engines`.
    engines_unusable: dict[str, str]
    gpus: list[dict]
    memory_gb: int
    disk_free_bytes: int
    labels: dict[str, str]
    # The replicas this node is running or starting (wanted in its engine state): the
    # control plane sends again a start that never arrived, and stops one it does not know.
    replicas: list[int]
    # Can hold a share of one replica across several nodes (issue 37, contracts/groups.py):
    # llama.cpp's rpc-server and stunnel are here and run. Absent from agents before it.
    rpc: bool
    # Can be a group's head: its llama-server was built with the RPC backend (takes --rpc).
    rpc_head: bool


class ReplicaReport(TypedDict):
    """What a node says of one replica it runs."""

    replica: int
    state: str  # one of REPLICA_STATES
    # Where the engine answers, when ready: exactly http://ADDRESS:PORT/v1, ADDRESS the one
    # the node was enrolled with (loopback without one); anything else is refused.
    endpoint: str
    reason: str
    # "worker" for a share of a replica across several nodes (contracts/groups.py): the node
    # runs that replica's rpc-server, not its engine. Absent for a replica's own engine.
    role: NotRequired[str]


class FetchReport(TypedDict, total=False):
    """How one fetch on a node ended."""

    node: str
    source: str
    state: str  # one of FETCH_ENDINGS
    path: str
    error: str
    bytes_total: int
    files_total: int
    seconds: float
    started: float  # when the run began, to tell it from a newer request of the same source


# --- what a node says often, posted for the control plane to take in batches ------------
#
# A heartbeat every 15 s from a thousand nodes, and each replica's report repeated every
# minute, would be a hundred Celery messages a second: Celery's own work, a few ms a
# message, was a third of a core. So the node writes them into Redis under its own prefix
# (contracts/keys.py: its heartbeat, and a hash of its reports, a field per replica: the
# latest wins) and asks for a collection only when none is pending; the control plane takes
# every enrolled node's entries in one pipeline, a second or so later. Each entry is the
# same signed message the task would carry, and is believed only with the node's signature.

COLLECT_PENDING_KEY = "llmgw:collect-pending"
# collect(): take every posted heartbeat and repeated report; sent by a node, delayed.
COLLECT = "fleet.collect"
COLLECT_DELAY_S = 1.0
# A collection that never ran (its worker died) is asked for again after this long.
COLLECT_PENDING_TTL_S = 30
# Where agents before issue 33 posted [token, ...]: taken and refused, said in the log.
OLD_HEARTBEATS_KEY = "llmgw:heartbeats"
OLD_REPORTS_KEY = "llmgw:replica-reports"


def _posted(pipe, send_task) -> None:
    """Ask for a collection unless one is already pending, with the post in the same round trip."""
    pipe.set(COLLECT_PENDING_KEY, "1", nx=True, ex=COLLECT_PENDING_TTL_S)
    if pipe.execute()[-1]:
        send_task(COLLECT, queue=CONTROL_QUEUE, countdown=COLLECT_DELAY_S)


def post_heartbeat(client, send_task, node: str, message: str) -> None:
    """Post a node's signed heartbeat (JSON); it lasts no longer than its signature does.

    `client` is a Redis client and `send_task` Celery's: passed in, so this module
    stays free of both.
    """
    pipe = client.pipeline(transaction=False)
    pipe.set(keys.heartbeat_key(node), message, ex=signing.REPORT_TTL_S)
    _posted(pipe, send_task)


def post_report(client, send_task, node: str, replica_id: int, message: str) -> None:
    """Post a node's signed replica report (JSON), the latest of the replica's."""
    key = keys.reports_key(node)
    pipe = client.pipeline(transaction=False)
    pipe.hset(key, str(replica_id), message)
    pipe.expire(key, signing.REPORT_TTL_S)
    _posted(pipe, send_task)


def take(client, nodes: list[str]) -> tuple[dict, dict, dict]:
    """What the given nodes posted so far, removed as it is taken, in one round trip:
    ({node: raw heartbeat}, {node: {replica id: raw report}}, {old key: {field: raw}}).

    The pending flag goes first, so anything posted from here on asks for the next collection.
    """
    client.delete(COLLECT_PENDING_KEY)
    pipe = client.pipeline(transaction=True)
    for node in nodes:
        pipe.getdel(keys.heartbeat_key(node))
        pipe.hgetall(keys.reports_key(node))
        pipe.delete(keys.reports_key(node))
    for old in (OLD_HEARTBEATS_KEY, OLD_REPORTS_KEY):
        pipe.hgetall(old)
        pipe.delete(old)
    replies = pipe.execute()
    heartbeats, reports = {}, {}
    for n, node in enumerate(nodes):
        beat, posted = replies[3 * n], replies[3 * n + 1]
        if beat is not None:
            heartbeats[node] = beat
        if posted:
            reports[node] = {_text(field): raw for field, raw in posted.items()}
    old = {
        OLD_HEARTBEATS_KEY: {_text(f): raw for f, raw in replies[-4].items()},
        OLD_REPORTS_KEY: {_text(f): raw for f, raw in replies[-2].items()},
    }
    return heartbeats, reports, old


def give_back(client, heartbeats: dict, reports: dict) -> None:
    """Put back what take() took but could not apply (the database went away): the next collection
    applies it. An entry the node posted meanwhile is newer and stays (the latest wins)."""
    pipe = client.pipeline(transaction=True)
    for node, raw in heartbeats.items():
        pipe.set(keys.heartbeat_key(node), raw, ex=signing.REPORT_TTL_S, nx=True)
    for node, posted in reports.items():
        for replica_id, raw in posted.items():
            pipe.hsetnx(keys.reports_key(node), replica_id, raw)
        pipe.expire(keys.reports_key(node), signing.REPORT_TTL_S)
    pipe.execute()


def _text(field) -> str:
    return field.decode(errors="replace") if isinstance(field, bytes) else str(field)
