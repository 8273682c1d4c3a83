"""What the control plane tells a node: start or stop a replica, signed for that node.

A node's agent runs a task only with a proof keyed by its enrolment token's hash
(contracts.signing), so anyone else who reaches the broker cannot start or stop its engines.
"""

from __future__ import annotations

from celery import current_app

from catalog.memory import prompt_cache_args
from catalog.models import Model
from contracts import credentials, groups, signing, tasks
from contracts.engine_args import kind_args

from . import memory
from .models import Node, Replica, ReplicaShare


def send_start(replica: Replica) -> None:
    node = replica.node
    # The model's kind travels as engine arguments (an embedding model is started with
    # llama.cpp's --embedding): inside the signed arguments, and checked by the node's allow-list.
    kind = Model.objects.filter(name=replica.model_name).values_list("kind", flat=True).first() or "chat"
    engine_args = list(replica.args) + kind_args(replica.engine, kind, replica.args)
    # llama-server's prompt cache, bounded to what the estimate counts for it (catalog.memory). A header
    # that is not numbers (issue 34) gives no estimate, and the cache is off: never an exception here.
    header = memory.headers_for([replica.source]).get(replica.source)
    engine_args += prompt_cache_args(replica.engine, header, engine_args)
    args = [replica.pk, replica.source, replica.engine, engine_args]
    # The name the gateway forwards as "model": vLLM refuses any other than the one it serves.
    # The nonce tells this replica's engine secret from an earlier replica's of the same id
    # (contracts.credentials); not secret itself, the node's token is.
    nonce = credentials.replica_nonce(replica.created)
    extra = {"model": replica.model_name, "nonce": nonce}
    shares = list(replica.shares.select_related("node"))
    if shares:
        # Workers first: the head's llama-server connects to them as it starts.
        for share in shares:
            send_start_worker(replica, share, nonce, ray_port(shares))
        extra["group"] = group_order(replica, node, shares, nonce)
        if replica.engine == "vllm":
            extra["group"]["ray_port"] = ray_port(shares)
    kwargs = signing.with_proof(node.token_hash, tasks.START_REPLICA, node.name, args, extra)
    current_app.send_task(tasks.START_REPLICA, args=args, kwargs=kwargs, queue=tasks.node_queue(node.name))


def ray_port(shares: list[ReplicaShare]) -> int:
    """The port of a vLLM group's Ray head (contracts/ray.py): the first worker's, from LLMGW_RPC_PORTS.

    A vLLM worker listens on no port of its own (it joins the head's Ray), so the port its share was
    given, in the range the fleet's firewall opens between nodes, is the head's Ray's.
    """
    return shares[0].port


def send_start_worker(replica: Replica, share: ReplicaShare, nonce: str, head_ray_port: int = 0) -> None:
    worker = share.node
    args = [replica.pk, share.port]
    extra = {
        "nonce": nonce,
        "head": replica.node.name,
        "source": replica.source,
        "memory_bytes": share.memory_gb << 30,
    }
    if replica.engine == "vllm":
        # The worker joins the head's Ray at its enrolled address (contracts/ray.py).
        extra.update(engine="vllm", head_address=replica.node.address or "127.0.0.1", ray_port=head_ray_port)
    kwargs = signing.with_proof(worker.token_hash, groups.START_RPC_WORKER, worker.name, args, extra)
    current_app.send_task(groups.START_RPC_WORKER, args=args, kwargs=kwargs, queue=tasks.node_queue(worker.name))


def group_order(replica: Replica, head: Node, shares: list[ReplicaShare], nonce: str) -> groups.GroupOrder:
    """What the head is told of its workers: each one's fenced address and its key, sealed for the head.

    The key is derived from the worker's token hash, which only the worker and the control plane
    hold, and sealed under the head's: a node that reads the broker sees nothing it can use.
    """
    workers = []
    for share in shares:
        psk = groups.rpc_psk(share.node.token_hash, replica.pk, nonce)
        workers.append(
            groups.GroupWorker(
                node=share.node.name,
                endpoint=f"{share.node.address or '127.0.0.1'}:{share.port}",
                sealed_psk=groups.seal_psk(head.token_hash, psk, replica.pk, nonce, share.node.name),
                share=share.share,
            )
        )
    return groups.GroupOrder(head_share=round(max(0.0, 1 - sum(s.share for s in shares)), 4), workers=workers)


def send_stop_workers(replica_id: int, node_names: list[str]) -> None:
    for name in node_names:
        key = Node.objects.filter(name=name).values_list("token_hash", flat=True).first() or ""
        args = [replica_id]
        kwargs = signing.with_proof(key, groups.STOP_RPC_WORKER, name, args)
        current_app.send_task(groups.STOP_RPC_WORKER, args=args, kwargs=kwargs, queue=tasks.node_queue(name))


def send_stop(replica_id: int, node_name: str) -> None:
    key = Node.objects.filter(name=node_name).values_list("token_hash", flat=True).first() or ""
    args = [replica_id]
    kwargs = signing.with_proof(key, tasks.STOP_REPLICA, node_name, args)
    current_app.send_task(tasks.STOP_REPLICA, args=args, kwargs=kwargs, queue=tasks.node_queue(node_name))
