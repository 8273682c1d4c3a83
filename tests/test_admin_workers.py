"""`manage.py gateway --workers 2`: two processes on one port, and keys, usage and routing stay right.

Each worker process has its own table in memory, its own usage counts and its own
connection pool; the kernel hands each new connection to one of them. These tests
open a fresh connection per request so both processes answer, and check from /proc
(psutil) that both did.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import requests
from django.db.models import Sum

from catalog.models import Model
from fleet.models import Replica
from gateway.keys import create_key
from gateway.models import Usage

from .fake_replica import FakeReplica
from .support.factories import add_model, add_replica
from .support.gateway import clear_of_minute_boundary, client, until_routed
from .support.gateway_process import start_gateway
from .support.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def two_workers(transactional_db, tmp_path):
    process, url = start_gateway(tmp_path, workers=2)
    workers = wait_until(lambda: _workers(process.popen.pid), timeout=30, what="two worker processes")
    yield url, workers
    process.stop()


def _workers(pid: int) -> list[int] | None:
    """The uvicorn worker processes under the supervisor, once both are there."""
    found = [
        p.pid
        for p in psutil.Process(pid).children(recursive=True)
        if "multiprocessing.resource" not in " ".join(p.cmdline())
    ]
    return found if len(found) >= 2 else None


def _post(url: str, secret: str, model: str = "chat", **body) -> requests.Response:
    # requests.post: a new connection each time, so the kernel picks a worker for each.
    return requests.post(
        url + "/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "hi"}], **body},
        headers={"Authorization": f"Bearer {secret}", "Connection": "close"},
        timeout=30,
    )


def _holding(workers: list[int], port: int) -> set[int]:
    """Which worker processes hold a connection to the replica on `port`."""
    holding = set()
    for pid in workers:
        for conn in psutil.Process(pid).net_connections(kind="tcp"):
            if conn.raddr and conn.raddr.port == port and conn.status == psutil.CONN_ESTABLISHED:
                holding.add(pid)
    return holding


def _both_route_to(url: str, secret: str, workers: list[int], replica: FakeReplica, model: str) -> list:
    """Held streams, each on a new connection, until both workers hold one to `replica`."""
    held = []
    for _ in range(40):
        held.append(
            requests.post(
                url + "/v1/chat/completions",
                json={"model": model, "messages": [], "stream": True, "hold": True},
                headers={"Authorization": f"Bearer {secret}"},
                stream=True,
                timeout=30,
            )
        )
        assert held[-1].status_code == 200, held[-1].text
        if _holding(workers, replica.port) == set(workers):
            return held
    raise AssertionError(f"after 40 streams only {_holding(workers, replica.port)} of {workers} reached the replica")


def test_two_workers_share_a_keys_limit_and_count_each_request_once(two_workers, replicas):
    url, workers = two_workers
    add_model()
    replica = replicas()
    replica.usage = {"prompt_tokens": 11, "completion_tokens": 3}
    add_replica("chat", replica.base)
    _, secret = create_key("thirty", limits={"requests_per_minute": 30})
    _, free = create_key("unlimited")
    until_routed(client(secret), url)
    # Both processes are answering, and each has the model routed.
    for stream in _both_route_to(url, free, workers, replica, "chat"):
        replica.release.set()
        stream.close()
    replica.release.clear()
    clear_of_minute_boundary()

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: _post(url, secret), range(50)))
    statuses = [a.status_code for a in answers]
    # Each process counting on its own would let up to 60 through.
    assert statuses.count(200) == 30 and statuses.count(429) == 20, statuses

    def written():
        total = Usage.objects.filter(key__name="thirty").aggregate(
            requests=Sum("requests"), prompt=Sum("prompt_tokens"), completion=Sum("completion_tokens")
        )
        return total if total["requests"] == 30 else None

    # Usage is counted once per answered request, by whichever process answered it.
    total = wait_until(written, timeout=15, what="the usage of 30 requests to be written")
    assert (total["prompt"], total["completion"]) == (330, 90)
    assert sum(1 for body in replica.requests if body.get("messages") != []) == 30


def test_a_catalog_change_reaches_both_workers_routing(two_workers, replicas):
    url, workers = two_workers
    add_model()
    old, new = replicas("old"), replicas("new")
    first = add_replica("chat", old.base)
    _, secret = create_key("router")
    until_routed(client(secret), url)
    for stream in _both_route_to(url, secret, workers, old, "chat"):
        old.release.set()
        stream.close()

    # The replica moves: the old one stops, a new one is ready, and a second model arrives.
    Replica.objects.filter(pk=first.pk).update(state=Replica.State.STOPPING)
    add_replica("chat", new.base)
    add_model("later")
    add_replica("later", new.base)
    seen_by_old = len(old.requests)
    wait_until(
        lambda: all(_post(url, secret, "later").status_code == 200 for _ in range(6)),
        timeout=10,
        what="both workers to route the new model",
    )
    # A fixed pause to prove an absence below: five of the gateway's refreshes here (100 ms), so each
    # worker has read the change, and none routes to the stopped replica after it.
    time.sleep(0.5)
    held = _both_route_to(url, secret, workers, new, "chat")
    assert len(old.requests) == seen_by_old, "a worker still routed to the stopped replica"
    new.release.set()
    for stream in held:
        stream.close()

    # A model removed from the catalog is gone from both.
    Model.objects.filter(name="later").delete()
    wait_until(
        lambda: all(_post(url, secret, "later").status_code == 404 for _ in range(6)),
        timeout=10,
        what="both workers to drop the removed model",
    )
