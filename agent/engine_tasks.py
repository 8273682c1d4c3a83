"""The tasks a node's agent runs for replicas: fetch the weights, hand the engine to the supervisor.

They arrive on the node's own queue (`node.NAME`). Starting the engine is left to
the supervisor, which outlives the task: the task is done once the weights are
whole and the replica is recorded as wanted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from celery import shared_task
from django.conf import settings

from contracts.tasks import START_REPLICA, STOP_REPLICA

from . import engine_state, engines, progress, runtime, supervisor
from .fetch import FetchError, fetch_source
from .tasks import FromControlPlane, report_fetch

log = logging.getLogger(__name__)


def start_on_node(
    replica_id: int,
    source: str,
    engine: str,
    args: list[str],
    *,
    cache: Path,
    fetch: Callable[[str, Path], Path],
    report: supervisor.Report,
    allow_remote_code: bool = False,
    model: str = "",
    nonce: str = "",
    group: dict | None = None,
) -> bool:
    """Fetch and hand over one replica; False when it failed (and was reported so).

    `model` is the catalog's name, which the engine is to serve under; `nonce` goes
    into its engine's secret (contracts.credentials). `group` is a contracts.groups.GroupOrder
    when this node heads a replica across several nodes.
    """
    try:
        if engine not in engines.ENGINES:
            raise engines.EngineError(f"no engine called {engine!r}; llmgw runs {' and '.join(engines.ENGINES)}")
        # Refused before fetching: gigabytes downloaded for an engine that will not start help nobody.
        engines.refuse_args(engine, list(args), allow_remote_code)
    except engines.EngineError as e:
        report(replica_id, "failed", "", str(e))
        return False
    ray_port = group.get("ray_port") if isinstance(group, dict) else None
    if group is not None and engine == "vllm" and not (isinstance(ray_port, int) and 0 < ray_port < 65536):
        # vLLM's group runs over a Ray head on this node (contracts/ray.py), at the port the order gives.
        report(replica_id, "failed", "", "a vLLM replica across several nodes needs the port of its head's Ray")
        return False
    if engine_state.wanted_as(cache, replica_id, engine, source, list(args), model, nonce, group):
        return True
    report(replica_id, "fetching", "", "")
    try:
        weights = fetch(source, cache)
    except Exception as e:
        # The fetch module's errors are sentences; anything else is said as it is.
        report(replica_id, "failed", "", str(e) or e.__class__.__name__)
        return False
    engine_state.want(cache, replica_id, engine, source, weights, list(args), model, nonce, group)
    return True


@shared_task(name=START_REPLICA, base=FromControlPlane, ignore_result=True, acks_late=True, reject_on_worker_lost=True)
def start_replica(
    replica_id: int, source: str, engine: str, args: list[str], model: str = "", nonce: str = "", group=None
) -> None:
    # `model` and `nonce` have defaults: a start queued before the control plane sent them
    # still runs, the engine under its own default name, its secret made without a nonce.
    start_on_node(
        replica_id,
        source,
        engine,
        args,
        cache=runtime.cache_dir(),
        fetch=fetch_reported,
        report=supervisor.celery_report(runtime.key()),
        allow_remote_code=settings.LLMGW_ALLOW_REMOTE_CODE,
        model=model,
        nonce=nonce,
        group=group,
    )


def fetch_reported(source: str, cache: Path) -> Path:
    """A replica's fetch, seen like any other: live progress under the source's
    address, and a record on the control plane of how it ended, which placement
    also reads to prefer a node that already holds the weights."""
    live = progress.RedisProgress(progress.redis_client(), source, runtime.node_name())
    started = time.time()
    try:
        path = fetch_source(source, cache, live)
    except FetchError as error:
        report_fetch(source, "failed", live.snapshot(), error=str(error), started=started)
        raise
    report_fetch(source, "complete", live.snapshot(), path=str(path), started=started)
    return path


@shared_task(name=STOP_REPLICA, base=FromControlPlane, ignore_result=True)
def stop_replica(replica_id: int) -> None:
    if not engine_state.unwant(runtime.cache_dir(), replica_id):
        # Nothing of that id runs here: say so, and the control plane lets the row go.
        supervisor.celery_report(runtime.key())(replica_id, "stopped", "", "")
