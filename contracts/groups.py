"""One replica across several nodes (issue 37): what the control plane and the nodes say to each other.

A group is one replica: a head node runs the engine (llama-server with `--rpc`), each worker
node runs llama.cpp's `rpc-server` for its share of the layers. `rpc-server` has no
authentication, so it listens on the worker's loopback only, and an authenticated
transport (stunnel with a pre-shared key) carries the head's connections across the
fleet network: only a holder of the key gets through.

The key never crosses the broker in the clear, as no credential does (contracts/credentials.py):
- the worker derives it from its own token hash (`rpc_psk`);
- the control plane, which stores every node's token hash, derives the same and sends it to
  the head sealed under the head's token hash (`seal_psk`); the head opens it (`open_psk`).
A node that reads the broker sees only the sealed form, which is worthless without the
head's token. Each (replica, nonce, worker) has its own key, so a replaced group's keys differ.

Messages (signed like every order, contracts/signing.py):
- START_RPC_WORKER to each worker's queue: args [replica_id, port], extra
  {"nonce": replica nonce, "head": head node name, "source": mirror address,
  "memory_bytes": what this worker's share needs}. The worker starts rpc-server on loopback
  (its tensor cache `-c` kept across restarts) and stunnel listening on its enrolled address
  at `port`; it reports with the usual replica report, `role` "worker", state "ready" when
  both answer, "failed" with a sentence when either dies.
- STOP_RPC_WORKER to a worker's queue: args [replica_id].
- START_REPLICA to the head, as for any replica, with extra["group"] a GroupOrder: the head
  opens each worker's sealed key, runs one stunnel client per worker on its own loopback and
  starts llama-server with `--rpc` those loopback ports and `--tensor-split` the shares.
  A worker's connection lost fails the replica with a sentence naming that worker.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import NotRequired, TypedDict

START_RPC_WORKER = "agent.start_rpc_worker"
STOP_RPC_WORKER = "agent.stop_rpc_worker"


# stunnel's PSK identity: the same on both sides, names the replica.
def psk_identity(replica_id: int) -> str:
    return f"llmgw-replica-{int(replica_id)}"


class GroupWorker(TypedDict):
    node: str  # the worker node's name
    endpoint: str  # ADDRESS:PORT, the worker's enrolled address and the port of its stunnel
    sealed_psk: str  # hex, seal_psk(head token hash, worker psk, ...)
    share: float  # this worker's part of the layers, for --tensor-split


class GroupOrder(TypedDict):
    head_share: float  # the head's own part of the layers
    workers: list[GroupWorker]  # in the order of --rpc and --tensor-split after the head's
    ray_port: NotRequired[int]  # a vLLM group's: the port of the head's Ray (contracts/ray.py)


def _mac(key: str, message: str) -> bytes:
    return hmac.new(key.encode(), message.encode(), hashlib.sha256).digest()


def rpc_psk(worker_key: str, replica_id: int, nonce: str) -> str:
    """The worker's pre-shared key for one replica, hex; `worker_key` is the worker node's token hash."""
    return _mac(worker_key, f"rpc:{int(replica_id)}:{nonce}").hex()


def _pad(head_key: str, replica_id: int, nonce: str, worker: str) -> bytes:
    return _mac(head_key, f"rpc-seal:{int(replica_id)}:{nonce}:{worker}")


def seal_psk(head_key: str, psk: str, replica_id: int, nonce: str, worker: str) -> str:
    """The worker's key as the head receives it: XOR with a pad only the head can make (one pad per key)."""
    data = bytes.fromhex(psk)
    pad = _pad(head_key, replica_id, nonce, worker)
    return bytes(a ^ b for a, b in zip(data, pad, strict=True)).hex()


def open_psk(head_key: str, sealed: str, replica_id: int, nonce: str, worker: str) -> str:
    """The head's side of seal_psk: `head_key` is the head node's own token hash."""
    return seal_psk(head_key, sealed, replica_id, nonce, worker)
