"""The agent's tasks: a fetch on a node's own queue, and its report on the control plane's.

A node has no database. What it has to say goes to `control` as a task, signed with the
node's key (contracts.signing `sign_message`); the control plane believes the signature,
not the worker. The token itself never leaves the node.
"""

from __future__ import annotations

import json
import logging
import os
import time

from celery import Task, current_app, shared_task

from contracts import signing
from contracts.progress import cancel_key, clear_cancel
from contracts.tasks import CONTROL_QUEUE, FETCH, FETCH_FINISHED, HEARTBEAT, node_queue, post_heartbeat

from . import engine_state, facts, memory, progress, runtime
from .fetch import FetchError, fetch_source

log = logging.getLogger(__name__)


def report_fetch(
    source: str, state: str, snapshot: dict, path: str = "", error: str = "", started: float = 0.0
) -> None:
    """Tell the control plane how a fetch ended. Sent, never waited on: the node has no database."""
    payload = {
        "node": runtime.node_name(),
        "source": source,
        "state": state,
        "path": path,
        "error": error,
        "bytes_total": snapshot.get("bytes_total", 0),
        "files_total": snapshot.get("files_total", 0),
        "seconds": round(time.time() - started, 3) if started else 0,
        "started": started,
    }
    try:
        message = signing.sign_message(runtime.key(), FETCH_FINISHED, runtime.node_name(), payload)
        current_app.send_task(FETCH_FINISHED, args=[message], queue=CONTROL_QUEUE)
    except Exception:
        # The fetch itself is done or failed either way; the progress key in Redis still says which.
        log.exception("could not report the fetch of %s to the control plane", source)


class FromControlPlane(Task):
    """A task the control plane sends this node: run only with a proof that it did.

    Anyone who can reach Redis can put a message on this node's queue; one without a
    valid proof (none, another node's, other arguments, expired) is dropped here and
    said in the log, never run. Acknowledged all the same, so it is not delivered again.
    """

    # The messages carry `proof`, which __call__ takes off before the task's own function
    # sees them; Celery must not check them against that function's signature on a retry.
    typing = False

    def __call__(self, *args, **kwargs):
        proof = kwargs.pop(signing.PROOF, None)
        problem = signing.proof_problem(
            runtime.key(),
            self.name,
            runtime.node_name(),
            list(args),
            kwargs,
            proof,
        )
        if problem is not None:
            # Cut short: what is logged here was written by whoever forged it.
            what = f"{tuple(args)!r} {kwargs!r}"
            what = what if len(what) <= 300 else what[:300] + "..."
            log.warning("dropped %s%s from the queue, not run: %s", self.name, what, problem)
            return None
        return super().__call__(*args, **kwargs)


class OnThisNode(FromControlPlane):
    """A task of this node's own queue, retried there: no route by its name may send it elsewhere."""

    def retry(self, args=None, kwargs=None, *more, **options):
        options.setdefault("queue", node_queue(runtime.node_name()))
        # The retry is a new message on the queue, and must carry a proof like any other:
        # the node signs its own retry (it holds its key), so a backoff longer than what
        # is left of the first proof does not drop it.
        args = list(self.request.args if args is None else args)
        kwargs = dict(self.request.kwargs if kwargs is None else kwargs)
        kwargs.pop(signing.PROOF, None)
        kwargs = signing.with_proof(runtime.key(), self.name, runtime.node_name(), args, kwargs)
        return super().retry(args, kwargs, *more, **options)


# Late acknowledgement with reject-on-worker-lost: a worker killed mid-download
# leaves the task to run again, and because a fetch is safe to run twice the
# rerun finds the parts on disk and resumes them.
@shared_task(
    name=FETCH,
    base=OnThisNode,
    bind=True,
    acks_late=True,
    reject_on_worker_lost=True,
    ignore_result=True,
    # Only a transient FetchError with tries left leaves the task (see below). Backoff
    # with jitter, so a mirror that restarts is not met by every node at once.
    autoretry_for=(FetchError,),
    max_retries=5,
    retry_backoff=5,
    retry_backoff_max=300,
    retry_jitter=True,
)
def fetch(self, source: str) -> None:
    node = runtime.node_name()
    client = progress.redis_client()
    started = time.time()
    if client.exists(cancel_key(node, source)):
        # Cleared, so the flag cannot stop a later fetch of the same source (a replica's).
        clear_cancel(client, node, source)
        report_fetch(source, "cancelled", {}, error="cancelled by staff before it started", started=started)
        return
    live = progress.RedisProgress(client, source, node)
    try:
        path = fetch_source(source, runtime.cache_dir(), live)
    except FetchError as error:
        sentence = str(error)
        if client.exists(cancel_key(node, source)):
            clear_cancel(client, node, source)
            report_fetch(source, "cancelled", live.snapshot(), error=sentence, started=started)
            return
        if error.transient and self.request.retries < self.max_retries:
            # Not "failed" to whoever watches: it is waiting to try again, and says why.
            try:
                live.set_state("queued")
            except progress.Cancelled:
                pass
            attempt = self.request.retries + 1
            log.warning(
                "fetch of %s failed, trying again in a while (attempt %d of %d): %s",
                source,
                attempt,
                self.max_retries + 1,
                sentence,
            )
            raise
        log.warning("fetch of %s failed: %s", source, sentence)
        report_fetch(source, "failed", live.snapshot(), error=sentence, started=started)
        return
    report_fetch(source, "complete", live.snapshot(), path=str(path), started=started)


def send_heartbeat(static: dict | None = None) -> None:
    """One heartbeat from this node: its facts, signed and posted for the control plane's next collection.

    A broker that is away is tried again at the next beat, not retried here: the
    worker's event loop runs this and must not stall on it (the client's timeouts are short).
    """
    labels = json.loads(os.environ.get("LLMGW_NODE_LABELS", "{}") or "{}")
    payload = facts.collect(runtime.node_name(), labels, runtime.cache_dir(), static)
    payload["replicas"] = engine_state.wanted_ids(runtime.cache_dir())
    # What each replica's engine really holds, and what the node has free (docs/placement.md).
    payload.update(memory.heartbeat_facts(runtime.cache_dir()))
    node = runtime.node_name()
    message = signing.sign_message(runtime.key(), HEARTBEAT, node, payload)
    post_heartbeat(progress.redis_client(), current_app.send_task, node, json.dumps(message))
