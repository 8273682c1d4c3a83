"""The gateway on its own port and in its own process, serving while the control plane is away.

Real processes: `manage.py gateway` and `manage.py admin_server` on the tests'
PostgreSQL and Redis, which these tests stop and start again under them
(tests/gateway_process.py), in front of a replica that answers a known usage.
"""

from __future__ import annotations

import threading
import time
from datetime import datetime

import pytest
import requests
from django.db.models import Sum

from gateway.keys import create_key
from gateway.models import ApiKey, Usage

from .support.factories import add_model, add_replica
from .support.gateway import chat, client, error_of, until_routed
from .support.gateway_process import start_gateway, start_postgres, start_redis, stop_postgres, stop_redis
from .support.processes import start_admin_server, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

# How long PostgreSQL stays stopped under load: the minute.
OUTAGE_S = 60


def test_v1_answers_on_the_gateways_port_and_the_admin_port_sends_clients_there(tmp_path, processes, replicas):
    add_model()
    add_replica("chat", replicas().base)
    _, secret = create_key("k")
    gateway, gateway_url = start_gateway(tmp_path, LLMGW_GATEWAY_URL="https://api.example.org/")
    admin, admin_url = start_admin_server(tmp_path, LLMGW_GATEWAY_URL="https://api.example.org/")
    processes += [gateway, admin]
    session = client(secret)
    until_routed(session, gateway_url)
    assert chat(session, gateway_url).status_code == 200
    for path in ("/v1/chat/completions", "/v1/models", "/v1"):
        moved = session.post(admin_url + path, json={"model": "chat", "messages": []})
        assert moved.status_code == 404
        error = error_of(moved)
        assert error["code"] == "gateway_elsewhere"
        assert f"https://api.example.org{path}" in error["message"]
    # The admin port still serves its own pages; the gateway's port serves none of them.
    assert requests.get(admin_url + "/admin/login/", timeout=10).status_code == 200
    assert requests.get(gateway_url + "/admin/login/", timeout=10).status_code == 404
    assert requests.get(gateway_url + "/api/fleet/nodes/", timeout=10).status_code == 404


class Load:
    """Clients asking the gateway for chats one after another, each answer and failure counted."""

    def __init__(self, url: str, secret: str, clients: int = 4) -> None:
        self.url, self.secret = url, secret
        self.answered = 0
        self.failures: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]
        for thread in self._threads:
            thread.start()

    def _run(self) -> None:
        session = client(self.secret)
        while not self._stop.is_set():
            try:
                answer = chat(session, self.url)
                ok, said = answer.status_code == 200, f"{answer.status_code} {answer.text[:200]}"
            except requests.RequestException as error:
                ok, said = False, repr(error)
            with self._lock:
                if ok:
                    self.answered += 1
                else:
                    self.failures.append(said)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)


def usage_written(key: ApiKey) -> tuple[int, int, int]:
    totals = Usage.objects.filter(key=key).aggregate(Sum("requests"), Sum("prompt_tokens"), Sum("completion_tokens"))
    return tuple(totals[name] or 0 for name in ("requests__sum", "prompt_tokens__sum", "completion_tokens__sum"))


def spool_empty(*directories) -> bool:
    """No batch waits, and every journal left is one that is still being written to (empty or not yet closed)."""
    return not any(path.name.endswith(".batch") for directory in directories for path in directory.iterdir())


def test_a_postgresql_outage_of_a_minute_under_load_loses_no_request_and_no_token_of_usage(
    tmp_path, processes, replicas
):
    add_model()
    replica = replicas()
    add_replica("chat", replica.base)
    key, secret = create_key("k")
    gateway, url = start_gateway(tmp_path, workers=2)
    processes.append(gateway)
    session = client(secret)
    until_routed(session, url)
    fresh = session.get(url + "/v1/models").json()["table"]
    assert fresh["stale"] is False and fresh["stale_since"] is None and fresh["read_at"]

    load = Load(url, secret)
    wait_until(lambda: load.answered >= 20, timeout=30, what="the load to be answered")
    stop_postgres()
    stopped_at = time.time()
    try:
        # /v1/models says the table is stale, and since when (each worker finds out by itself).
        def stale():
            table = session.get(url + "/v1/models", timeout=10).json()["table"]
            return table if table["stale"] else None

        table = wait_until(stale, timeout=15, what="/v1/models to say the table is stale")
        assert stopped_at - 2 <= datetime.fromisoformat(table["stale_since"]).timestamp() <= time.time()
        assert "cannot read its table" in gateway.output()
        # A gateway started during the outage says so in one line, and answers 503 until it has a table.
        late, late_url = start_gateway(tmp_path, name="late-gateway", wait_status=503)
        processes.append(late)
        waiting = client(secret).get(late_url + "/v1/models", timeout=10)
        assert waiting.status_code == 503 and error_of(waiting)["code"] == "table_unavailable"
        said = [line for line in late.output().splitlines() if "cannot read its table from the database yet" in line]
        assert len(said) == 1, late.output()
        # The outage lasts; the load goes on being answered from the table read before it.
        answered_before = load.answered
        wait_until(lambda: time.time() - stopped_at >= OUTAGE_S, timeout=OUTAGE_S + 5, interval=1, what="the outage")
        assert load.answered > answered_before + 100, "the gateway stopped answering during the outage"
        assert len(late.output().splitlines()) < 40, "the late gateway logs the outage more than once"
    finally:
        start_postgres()
    wait_until(lambda: not stale(), timeout=15, what="/v1/models to say the table is fresh again")
    # The late gateway serves as soon as it can read a table.
    wait_until(lambda: chat(client(secret), late_url).status_code == 200, timeout=15, what="the late gateway")
    load.stop()
    assert load.failures == []
    answered = load.answered + 1  # and the late gateway's one
    # Every answer counted once, to the token: the replica says 11 prompt and 3 completion tokens each.
    spools = [tmp_path / "gateway-spool", tmp_path / "late-gateway-spool"]
    wait_until(lambda: spool_empty(*spools) and usage_written(key)[0] == answered, timeout=30, what="usage")
    gateway.stop()  # its journal closed and written at shutdown: nothing more to add
    assert answered == len(replica.requests)
    assert usage_written(key) == (answered, 11 * answered, 3 * answered)


def test_a_gateway_started_during_an_outage_serves_once_it_can_read_its_table(tmp_path, processes, replicas):
    add_model()
    add_replica("chat", replicas().base)
    key, secret = create_key("k")
    stop_postgres()
    try:
        gateway, url = start_gateway(tmp_path, wait_status=503)
        processes.append(gateway)
        refused = client(secret).post(url + "/v1/chat/completions", json={"model": "chat", "messages": []})
        assert refused.status_code == 503 and "has not read its table yet" in error_of(refused)["message"]
        assert refused.headers["retry-after"] == "1"
    finally:
        start_postgres()
    session = client(secret)
    wait_until(lambda: chat(session, url).status_code == 200, timeout=15, what="the gateway to serve")
    assert "the gateway read its table: 1 models, 1 keys; serving" in gateway.output()
    wait_until(lambda: usage_written(key)[0] == 1, timeout=15, what="its usage")


def test_with_redis_stopped_limits_fail_open_and_are_enforced_again_when_it_is_back(tmp_path, processes, replicas):
    add_model()
    add_replica("chat", replicas().base)
    key, secret = create_key("k")
    ApiKey.objects.filter(pk=key.pk).update(requests_per_minute=5)
    gateway, url = start_gateway(tmp_path)
    processes.append(gateway)
    session = client(secret)
    until_routed(session, url)
    wait_until(lambda: chat(session, url).status_code == 200, timeout=10, what="the key's limits to be read")
    stop_redis()
    try:
        # Redis away: the key's limits are not enforced (fail open), and the log says so once.
        answers = [chat(session, url).status_code for _ in range(8)]
        assert answers == [200] * 8
        assert gateway.output().count("per-key limits are not enforced while Redis cannot be reached") == 1
    finally:
        start_redis()
    # Back: the counts of before are gone with the Redis that held them (the tests' has no
    # persistence), and the limit counts from zero again: five more, then 429.
    wait_until(lambda: chat(session, url).status_code == 429, timeout=30, what="the limit to be enforced again")
    refused = chat(session, url)
    assert refused.status_code == 429 and "requests per minute" in error_of(refused)["message"]
    # Usage, kept in the spool and the database, lost nothing of the outage.
    wait_until(lambda: usage_written(key)[0] >= 1 + 8 + 4, timeout=15, what="usage of the outage")
