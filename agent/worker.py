"""The node's Celery worker: its queue, and the heartbeat that rides in its event loop.

The heartbeat is a worker bootstep on the worker's own timer, not a thread
beside it: it starts and stops with the worker, and nothing extra is running
when the prefork pool forks a new child.
"""

from __future__ import annotations

import logging

from celery import bootsteps
from django.conf import settings

log = logging.getLogger(__name__)


class Heartbeat(bootsteps.StartStopStep):
    requires = {"celery.worker.components:Timer"}

    def __init__(self, worker, **kwargs):
        super().__init__(worker, **kwargs)
        self.tref = None
        self.static = None

    def start(self, worker):
        from . import facts

        # Engines and GPUs change when somebody installs something; probed once,
        # so a slow nvidia-smi never stalls the worker's loop on every beat.
        self.static = facts.installed()
        self.beat()
        self.tref = worker.timer.call_repeatedly(float(settings.HEARTBEAT_S), self.beat, priority=10)

    def beat(self):
        from .tasks import send_heartbeat

        try:
            send_heartbeat(self.static)
        except Exception as error:
            log.warning("heartbeat not sent (%s); trying again in %s s", error, settings.HEARTBEAT_S)

    def stop(self, worker):
        if self.tref is not None:
            self.tref.cancel()
            self.tref = None


def install(app) -> None:
    app.steps["worker"].add(Heartbeat)
