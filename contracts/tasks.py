"""The messages between the control plane and the nodes: queues, task names, arguments.

Every message travels through Celery by name, so the name and the arguments are the
whole contract. A node's queue is `node.NAME`; the control plane's is `control`.
Names are never renamed: an agent of the last release may still be sending them.
"""

from __future__ import annotations

from typing import TypedDict

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

# --- sent by a node, on the control queue; the first argument is always its token --------

# heartbeat(token: str, facts: Facts)
HEARTBEAT = "fleet.heartbeat"
# fetch_finished(token: str, report: FetchReport)
FETCH_FINISHED = "agent.fetch_finished"
# replica_report(token: str, replica_id: int, state: str, endpoint: str = "", reason: str = "", seq: int = 0)
# `seq` is the report's order among this replica's reports on the node (see report_seq_key);
# the control plane ignores a report older than one it applied. 0 (an older agent): applied.
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


def report_seq_key(node: str, replica_id: int) -> str:
    """The node's counter of one replica's reports, in Redis: shared by the worker and the
    supervisor, which both report, and kept across the agent's restarts."""
    return f"llmgw:report-seq:{node}:{replica_id}"


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
# message, was a third of a core. So the node writes them into a Redis hash (one field
# per node, or per replica: the latest wins) and asks for a collection only when none is
# pending; the control plane takes the whole hash in one task a second or so. Each entry
# still carries the node's token and is believed only for the node the token enrols.

HEARTBEATS_KEY = "llmgw:heartbeats"  # field: node name; value: JSON [token, facts]
REPORTS_KEY = "llmgw:replica-reports"  # field: replica id; value: JSON [token, id, state, endpoint, reason, seq]
COLLECT_PENDING_KEY = "llmgw:collect-pending"
# collect(): take every posted heartbeat and repeated report; sent by a node, delayed.
COLLECT = "fleet.collect"
COLLECT_DELAY_S = 1.0
# A collection that never ran (its worker died) is asked for again after this long.
COLLECT_PENDING_TTL_S = 30


def post(client, send_task, key: str, field: str, value: str) -> None:
    """Post one entry; ask for a collection unless one is already pending.

    `client` is a Redis client and `send_task` Celery's: passed in, so this module
    stays free of both.
    """
    pipe = client.pipeline(transaction=False)
    pipe.hset(key, field, value)
    pipe.set(COLLECT_PENDING_KEY, "1", nx=True, ex=COLLECT_PENDING_TTL_S)
    _, first = pipe.execute()
    if first:
        send_task(COLLECT, queue=CONTROL_QUEUE, countdown=COLLECT_DELAY_S)


def take(client) -> tuple[dict, dict]:
    """({node: raw heartbeat}, {replica id: raw report}) posted so far, removed as they are taken.

    The pending flag goes first, so anything posted from here on asks for the next collection.
    """
    client.delete(COLLECT_PENDING_KEY)
    pipe = client.pipeline(transaction=True)
    pipe.hgetall(HEARTBEATS_KEY)
    pipe.delete(HEARTBEATS_KEY)
    pipe.hgetall(REPORTS_KEY)
    pipe.delete(REPORTS_KEY)
    heartbeats, _, reports, _ = pipe.execute()
    return heartbeats, reports
