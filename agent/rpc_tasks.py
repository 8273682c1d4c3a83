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
def start_rpc_worker(
    replica_id: int,
    port: int,
    nonce: str = "",
    head: str = "",
    engine: str = "llamacpp",
    head_address: str = "",
    ray_port: int = 0,
    **_more,
) -> None:
    # `source` and `memory_bytes` are the control plane's account of the share; the worker
    # needs neither (the head sends the tensors, or vLLM's Ray its part), and a field added
    # later is no reason to fail. `engine` "vllm" makes this share a Ray worker (contracts/ray.py).
    if problem := worker_problem(port, engine, head_address, ray_port):
        supervisor.celery_report(runtime.key())(replica_id, "failed", "", problem, role="worker")
        return
    Workers.want(
        runtime.cache_dir(), int(replica_id), int(port), str(nonce), str(head), str(engine), str(head_address), ray_port
    )


def worker_problem(port, engine: str, head_address: str, ray_port) -> str | None:
    """Why a worker's order cannot be run, in a sentence; None when it can."""
    if not 0 < int(port) < 65536:
        return f"port {port} is no TCP port"
    if engine not in ("llamacpp", "vllm"):
        return f"a share of a replica across nodes runs llamacpp or vllm, not {engine!r}"
    if engine == "vllm" and not (head_address and isinstance(ray_port, int) and 0 < ray_port < 65536):
        return f"the order names no head's Ray to join (address {head_address!r}, port {ray_port!r})"
    return None


@shared_task(name=STOP_RPC_WORKER, base=FromControlPlane, ignore_result=True)
def stop_rpc_worker(replica_id: int) -> None:
    if not Workers.unwant(runtime.cache_dir(), int(replica_id)):
        supervisor.celery_report(runtime.key())(replica_id, "stopped", "", "", role="worker")
