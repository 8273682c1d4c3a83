"""The Celery app class of every llmgw worker, the control worker's and each node's agent's.

A worker listens on its task queue and on nothing else: no remote control (pidbox),
no gossip, no mingle, no event heartbeat. Each of those is a fanout channel any Redis
client can publish on, and each was a way in: `celery control shutdown` made every worker
exit with status 0, `cancel_consumer control` stopped placement, `add_consumer node.B` on
agent A took B's orders (issue 33). Forced here rather than left to each command line (a
systemd unit, `make run`, a test), so a worker started any way is deaf to them; the Redis
ACL (fleet/redis_acl.py) refuses the channels besides.
"""

from __future__ import annotations

from celery import Celery
from celery.apps.worker import Worker
from kombu.utils.objects import cached_property

# What `--without-gossip --without-mingle --without-heartbeat` say on a command line.
QUIET_OPTIONS = {"without_gossip": True, "without_mingle": True, "without_heartbeat": True}


class QuietWorker(Worker):
    def __init__(self, *args, **kwargs):
        kwargs.update(QUIET_OPTIONS)
        # contracts.process_settings says so too; forced here for an app configured any other way,
        # in both spellings (an app configured with the CELERY_ namespace reads that one first).
        self.app.conf.update(
            worker_enable_remote_control=False,
            CELERY_WORKER_ENABLE_REMOTE_CONTROL=False,
            worker_send_task_events=False,
            CELERY_WORKER_SEND_TASK_EVENTS=False,
        )
        super().__init__(*args, **kwargs)


class QuietCelery(Celery):
    """A Celery app whose workers take orders from their queues only, and whose sends only push."""

    def send_task(self, name, args=None, kwargs=None, **options):
        # Pushed onto the queue it names, nothing declared: a declaration reads the queue's
        # length and adds to its bindings (`_kombu.binding.<queue>`), which a node's or a
        # gateway's Redis user may not do for the control queue; a queue's consumer declares it.
        options.setdefault("declare", [])
        return super().send_task(name, args, kwargs, **options)

    @cached_property
    def Worker(self):  # noqa: N802 (Celery's name)
        return self.subclass_with_self(QuietWorker)
