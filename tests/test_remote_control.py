"""Celery's remote control reaches no llmgw worker (issue 33).

Before, any Redis client could be a Celery app and broadcast: `shutdown` made the control
worker and every agent exit with status 0 (which `Restart=on-failure` does not restart),
`cancel_consumer control` stopped placement silently, and `add_consumer node.n2` on agent
n1 made n1 take n2's orders. Here a plain Celery app on the broker, with the broker's own
password (the session's Redis has no ACL: the workers' settings alone must hold), sends all
of it at the real control worker and a real agent, which go on with their work.
"""

from __future__ import annotations

import pytest
from celery import Celery
from django.conf import settings

from fleet.enrolment import issue_token
from fleet.models import Fetch, Node

from .support.mirror import put
from .support.processes import start_agent
from .support.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def test_shutdown_cancel_consumer_and_add_consumer_reach_neither_the_control_worker_nor_an_agent(
    enrolled_node, control_worker, byte_listener, mirror_root, agent_cache, tmp_path, redis_client
):
    name, token = enrolled_node
    issue_token("n2")  # a node whose orders n1 is told to take
    redis_client.delete("node.n1", "node.n2")
    agent = start_agent(name, token, agent_cache, tmp_path, LLMGW_BYTES_URL=byte_listener)
    try:
        # Not made the current app: else every shared task this process sends afterwards (a later test's
        # pull, say) goes through it, to its default queue "celery", which no llmgw worker takes.
        attacker = Celery("attacker", broker=settings.REDIS_URL, set_as_current=False)
        attacker.control.add_consumer("node.n2", destination=[f"agent@{name}"])
        attacker.control.cancel_consumer("control")
        attacker.control.cancel_consumer("node.n1")
        # Waiting for replies is the settle period that proves an absence: a worker listening
        # on the pidbox answers a ping within milliseconds, and these three were sent before it.
        assert attacker.control.ping(timeout=3) == []
        attacker.control.shutdown()
        attacker.control.broadcast("shutdown", destination=[f"agent@{name}", "control@" + _host()])

        # Both still consume: the agent takes n1's fetch, the control worker records its report.
        put(mirror_root, "m", "v1", {"a.bin": b"a" * 1000})
        Fetch.objects.request(Node.objects.get(name="n2"), byte_listener + "m/v1/")
        Fetch.objects.request(Node.objects.get(name=name), byte_listener + "m/v1/")
        wait_until(
            lambda: Fetch.objects.filter(node__name=name, state="complete").exists(),
            timeout=60,
            what=lambda: f"n1's fetch to be done and reported\n{agent.output()[-3000:]}\n{control_worker.output()[-2000:]}",
        )
        assert agent.alive(), agent.output()[-3000:]
        assert control_worker.alive(), control_worker.output()[-3000:]
        # n2's order waits for n2: n1 took nothing of its queue.
        assert redis_client.llen("node.n2") == 1
        assert Fetch.objects.get(node__name="n2").state == "requested"
        # Nothing of the pidbox was even listened to.
        assert "pidbox" not in agent.output() and "pidbox" not in control_worker.output()
    finally:
        agent.stop()


def _host() -> str:
    import socket

    return socket.gethostname()
