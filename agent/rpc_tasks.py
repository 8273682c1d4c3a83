"""The tasks of one replica across several nodes (contracts/groups.py) on a worker node.

They only record what is wanted (agent.rpc_group.Workers); the supervisor, which outlives
them and holds what starting a fenced process needs, starts and watches rpc-server and stunnel.
"""

from __future__ import annotations

from celery import shared_task

from contracts.groups import START_RPC_WORKER, STOP_RPC_WORKER

from . import runtime, supervisor
from .rpc_group import Workers
from .tasks import FromControlPlane


@shared_task(name=START_RPC_WORKER, base=FromControlPlane, ignore_result=True)
def start_rpc_worker(replica_id: int, port: int, nonce: str = "", head: str = "", **_more) -> None:
    # `source` and `memory_bytes` are the control plane's account of the share; the worker
    # needs neither (the head sends the tensors), and a field added later is no reason to fail.
    if not 0 < int(port) < 65536:
        supervisor.celery_report(runtime.key())(replica_id, "failed", "", f"port {port} is no TCP port", role="worker")
        return
    Workers.want(runtime.cache_dir(), int(replica_id), int(port), str(nonce), str(head))


@shared_task(name=STOP_RPC_WORKER, base=FromControlPlane, ignore_result=True)
def stop_rpc_worker(replica_id: int) -> None:
    if not Workers.unwant(runtime.cache_dir(), int(replica_id)):
        supervisor.celery_report(runtime.key())(replica_id, "stopped", "", "", role="worker")
