"""The node's Celery worker: its queue, and the heartbeat that rides in its event loop.

The heartbeat is a bootstep on the worker's own timer, not a thread beside it:
it starts and stops with the worker, and nothing extra is running when the
prefork pool forks a new child. A step of the consumer, not of the worker: when
the broker connection is lost (Redis restarted), Celery's consumer clears the
timer and starts again once connected; a worker step's repeating beat was cleared
with it and never set again, so the node fell silent for good and the control
plane took it for lost (tests/test_fleet_netns.py restarts Redis under the agents).
"""

from __future__ import annotations

import importlib
import logging
import threading
import time

from celery import bootsteps
from django.conf import settings
from kombu.utils.json import loads

from contracts import credentials, keys, signing

from . import facts
from .tasks import send_heartbeat

log = logging.getLogger(__name__)


class Heartbeat(bootsteps.StartStopStep):
    requires = {"celery.worker.consumer.connection:Connection"}

    def __init__(self, consumer, **kwargs):
        super().__init__(consumer, **kwargs)
        self.tref = None
        self.static = None
        self.probed_at = 0.0
        self.probing = threading.Lock()

    def start(self, consumer):
        # Engines and GPUs change when somebody installs something: probed at
        # start and every few minutes after, not on every beat, so a slow
        # nvidia-smi never stalls the worker's loop each time. Not again on a reconnection.
        if self.static is None:
            self.static = facts.installed()
            self.probed_at = time.monotonic()
        self.beat()
        self.tref = consumer.timer.call_repeatedly(float(settings.HEARTBEAT_S), self.beat, priority=10)

    def beat(self):
        if time.monotonic() - self.probed_at >= settings.AGENT_REPROBE_S and not self.probing.locked():
            self.probed_at = time.monotonic()
            # A re-probe runs each engine's self-test, which may take its whole timeout
            # (an engine that hangs): beside the loop, never in it. The heartbeat sends
            # the last facts meanwhile.
            threading.Thread(target=self.reprobe, name="agent-reprobe", daemon=True).start()
        try:
            send_heartbeat(self.static)
        except Exception as error:
            log.warning("heartbeat not sent (%s); trying again in %s s", error, settings.HEARTBEAT_S)

    def reprobe(self):
        with self.probing:
            # An engine installed since the last probe is a new module on disk.
            importlib.invalidate_caches()
            self.static = facts.installed()

    def stop(self, consumer):
        if self.tref is not None:
            self.tref.cancel()
            self.tref = None


def install(app) -> None:
    app.steps["consumer"].add(Heartbeat)


def use_own_broker(app, node: str, token: str) -> str:
    """Point this node's Celery app and Redis clients at its own Redis user and bookkeeping keys; returns the URL.

    With LLMGW_REDIS_ACL the user is `node-NAME` and the password is made from the
    token (contracts.credentials.redis_password), as the control plane makes it for the
    ACL: nothing more to hand a node than its token. The unacked keys are the node's own
    either way (contracts.keys.unacked_keys): kombu's default is one hash for every
    consumer. The processes the agent starts (its supervisor) make the same in their
    settings from LLMGW_NODE_NAME: no password goes into an environment.
    """
    url = settings.REDIS_URL
    if settings.REDIS_ACL:
        url = credentials.node_redis_url(url, node, signing.token_hash(token))
    options = dict(settings.CELERY_BROKER_TRANSPORT_OPTIONS, **keys.unacked_keys(node))
    settings.REDIS_URL = settings.CELERY_BROKER_URL = url
    settings.CELERY_BROKER_TRANSPORT_OPTIONS = options
    # The app reads its settings with the CELERY_ namespace; each spelling, whichever it looked at first.
    app.conf.update(
        CELERY_BROKER_URL=url, broker_url=url, CELERY_BROKER_TRANSPORT_OPTIONS=options, broker_transport_options=options
    )
    return url


def take_back_unacknowledged(app, queue: str) -> int:
    """Put back on this node's queue the tasks its previous run took and never finished.

    A worker killed outright (SIGKILL, power loss) leaves its late-acknowledged
    tasks in its unacked hash (its own: use_own_broker), and Redis gives them back only after the
    visibility timeout: hours, because a fetch may take hours. Only this node
    consumes node.NAME, so at start whatever is unacknowledged for that queue
    was taken by a run of this agent that is gone, and is safe to run again
    (every node task is). Done before the worker consumes, so nothing running
    now is touched. Returns how many tasks were put back.
    """
    restored = 0
    with app.connection_for_write() as connection:
        channel = connection.default_channel
        client = channel.client
        for tag, payload in client.hgetall(channel.unacked_key).items():
            try:
                _message, _exchange, routing_key = loads(payload)
            except (ValueError, TypeError):
                continue
            if routing_key == queue:
                channel.qos.restore_by_tag(tag, client)
                restored += 1
    return restored
