"""Draining a replica before its engine is stopped: the requests it is answering finish first.

A replica stopped while it serves (replaced after its profile was edited, its model's
count lowered, its node drained) is marked `stopping` at once, so every gateway drops it
from its table at its next read (within LLMGW_GATEWAY_REFRESH_MS) and sends it nothing
new. Its node is not told to stop it yet: a later pass tells it once the gateways' load
(contracts/demand.py, shared through Redis) has said "none in flight" for a snapshot
taken after the gateways stopped sending (SETTLE_S after it was marked), or after
LIMIT_S whatever the load says. Stopping the engine at once cut those answers short
(PyPI's llama.cpp server ends every open event stream on SIGTERM): bench/on_demand_change.py
saw 2 to 8 of 220 streams cut in a rolling replacement under 16 clients.

A replica of a model that has requests in flight waits SETTLE_S even when the last
snapshot shows none on the replica itself: that snapshot is up to a second old, and
until its next table read a gateway may still send the replica one (the bound of prefix
routing sends one to a replica the ring rarely names). Stopped at once on "none in
flight on it", such a stream was cut (tests/test_rolling_replacement.py, 1 stream in
about 80, in CI). A replica of a model with nothing in flight anywhere (idle, scaled to
zero, stopped to make room) is stopped at once: a wake that made room waits for no pass.

A replica across nodes (issue 37) drains as one: its row (the head's) is what is marked and
held here, and once it has drained its head and every worker are told to stop together
(fleet.reconcile.tell_stop), so no worker's rpc-server goes while its head still answers.
A group with a node draining is replaced elsewhere by placement (fleet.placement.stopping.leaving_draining)
and stopped through this same hold once the new group serves.
"""

from __future__ import annotations

from fleet.live import redis_client

# Long enough for every gateway to have re-read its table (1 s by default) and written a
# snapshot after that (once a second).
SETTLE_S = 3.0
# A request that runs longer than this on a replica being stopped is cut after all.
LIMIT_S = 60.0
_KEY = "llmgw:draining:{}"


def hold_stop(replica_id: int, in_flight: int, model_in_flight: int) -> bool:
    """Whether the node's stop is to wait for the replica's requests; remembered for later passes.

    `in_flight` is the replica's requests in flight, `model_in_flight` its model's, every gateway's.
    """
    if in_flight <= 0 and model_in_flight <= 0:
        return False
    redis_client().set(_KEY.format(replica_id), "1", ex=int(LIMIT_S) + 60)
    return True


def draining(replica_ids: list[int]) -> set[int]:
    """Which of these stopping replicas still wait for their requests to finish."""
    if not replica_ids:
        return set()
    found = redis_client().mget([_KEY.format(r) for r in replica_ids])
    return {r for r, value in zip(replica_ids, found, strict=True) if value is not None}


def drained(replica_id: int, waited_s: float, in_flight: int) -> bool:
    """Whether its stop goes now; when it does, the replica is no longer draining."""
    if waited_s < LIMIT_S and (waited_s < SETTLE_S or in_flight > 0):
        return False
    redis_client().delete(_KEY.format(replica_id))
    return True
