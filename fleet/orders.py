"""What the control plane tells a node: start or stop a replica, signed for that node.

A node's agent runs a task only with a proof keyed by its enrolment token's hash
(contracts.signing), so anyone else who reaches the broker cannot start or stop its engines.
"""

from __future__ import annotations

from celery import current_app

from catalog.memory import prompt_cache_args
from catalog.models import Model
from contracts import credentials, signing, tasks
from contracts.engine_args import kind_args

from . import memory
from .models import Node, Replica


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
    extra = {"model": replica.model_name, "nonce": credentials.replica_nonce(replica.created)}
    kwargs = signing.with_proof(node.token_hash, tasks.START_REPLICA, node.name, args, extra)
    current_app.send_task(tasks.START_REPLICA, args=args, kwargs=kwargs, queue=tasks.node_queue(node.name))


def send_stop(replica_id: int, node_name: str) -> None:
    key = Node.objects.filter(name=node_name).values_list("token_hash", flat=True).first() or ""
    args = [replica_id]
    kwargs = signing.with_proof(key, tasks.STOP_REPLICA, node_name, args)
    current_app.send_task(tasks.STOP_REPLICA, args=args, kwargs=kwargs, queue=tasks.node_queue(node_name))
