"""PostgreSQL stopped under the control plane (issue 38): the admin port answers a sentence, the collection loses nothing."""

import re

import pytest
import redis
import requests
from django.conf import settings
from django.test import Client

from common.database_away import SAID
from contracts import tasks
from fleet import reconcile, reports
from fleet import tasks as fleet_tasks
from fleet.enrolment import issue_token
from fleet.models import Node, Replica

from .support import node_messages as node
from .support.factories import add_node, add_served_model
from .support.fleet import sent
from .support.gateway_process import start_postgres, stop_postgres
from .support.people import person
from .support.processes import start_admin_server, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

NAMES = ("a", "b", "c")


def signed_in(url: str) -> requests.Session:
    """A requests session with a staff member's session cookie, as their browser holds it."""
    client = Client()
    client.force_login(person("ops", is_staff=True, is_superuser=True))
    session = requests.Session()
    session.cookies.set(settings.SESSION_COOKIE_NAME, client.cookies[settings.SESSION_COOKIE_NAME].value)
    return session


def test_pages_and_the_api_answer_a_sentence_while_the_database_is_away_and_serve_again_after(tmp_path):
    admin, url = start_admin_server(tmp_path)
    try:
        session = signed_in(url)
        pages = ("/me/", "/admin/", "/admin/login/?next=/admin/")
        assert session.get(url + "/api/fleet/nodes/", timeout=10).status_code == 200
        assert all(session.get(url + page, timeout=10).status_code == 200 for page in pages)
        stop_postgres()
        try:
            api = session.get(url + "/api/fleet/nodes/", timeout=10)
            assert api.status_code == 503, api.text[:500]
            assert api.json() == {"detail": SAID} and api.headers["Retry-After"] == "5"
            for page in pages:
                answer = session.get(url + page, timeout=10)
                assert answer.status_code == 503, (page, answer.text[:500])
                assert SAID in answer.text and "Traceback" not in answer.text
                assert answer.headers["Retry-After"] == "5"
            # Signing in reads the user: a sentence too, not Django's error page.
            login = requests.Session()
            form = login.get(url + "/admin/login/", timeout=10)
            token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', form.text)
            answer = login.post(
                url + "/admin/login/",
                data={"username": "ops", "password": "x", "csrfmiddlewaretoken": token[1] if token else ""},
                headers={"Referer": url + "/admin/login/"},
                timeout=10,
            )
            assert answer.status_code == 503 and SAID in answer.text, answer.text[:500]
        finally:
            start_postgres()

        def serves() -> bool:
            return session.get(url + "/api/fleet/nodes/", timeout=10).status_code == 200

        wait_until(serves, timeout=30, what="the API to serve once PostgreSQL is back")
        assert all(session.get(url + page, timeout=10).status_code == 200 for page in pages)
        # One line for the whole outage, and no traceback.
        said = [line for line in admin.output().splitlines() if "the database is not answering" in line]
        assert len(said) == 1, admin.output()[-3000:]
        assert "Traceback" not in admin.output(), admin.output()[-3000:]
    finally:
        admin.stop()


@pytest.fixture
def collections_broker():
    client = redis.Redis.from_url(settings.REDIS_URL)
    shared = (tasks.COLLECT_PENDING_KEY, tasks.CONTROL_QUEUE)
    client.delete(*shared, *node.node_keys(client, *NAMES))
    yield client
    client.delete(*shared, *node.node_keys(client, *NAMES))


def test_heartbeats_and_reports_taken_when_the_database_goes_away_are_collected_once_it_is_back(
    collections_broker, monkeypatch, caplog
):
    for name in NAMES:
        issue_token(name)
    replica = Replica.objects.create(model_name="m", profile_name="cpu", node=Node.objects.get(name="a"))
    for name in NAMES:
        node.post_heartbeat(collections_broker, name, node.heartbeat(name, {"memory_gb": 8}))
    node.post_report(
        collections_broker, "a", replica.pk, node.report("a", replica.pk, "ready", "http://127.0.0.1:9/v1")
    )
    # Signed before the outage (the test reads each node's key from the database); posted during it.
    newer = node.heartbeat("c", {"memory_gb": 16})
    late = node.heartbeat("b", {"memory_gb": 12})

    taken = tasks.take

    def taken_then_database_stopped(*args):
        # PostgreSQL goes away between the collection's reads: after it took the batch, before it applied it.
        batch = taken(*args)
        stop_postgres()
        return batch

    monkeypatch.setattr(tasks, "take", taken_then_database_stopped)
    try:
        fleet_tasks.collect()
        monkeypatch.setattr(tasks, "take", taken)
        assert collections_broker.exists(*node.node_keys(collections_broker, *NAMES)) == 4, (
            "what was taken was not given back"
        )
        node.post_heartbeat(collections_broker, "c", newer)
        node.post_heartbeat(collections_broker, "b", late)
        # The control worker's passes meanwhile wait, each with a line, and take nothing.
        fleet_tasks.collect()
        fleet_tasks.reconcile()
        assert "reconcile waits for the database" in caplog.text
        assert "Traceback" not in caplog.text
    finally:
        start_postgres()
    fleet_tasks.collect()  # the next pass (the reconcile beat calls it first)
    nodes = {n.name: n for n in Node.objects.all()}
    assert all(nodes[name].last_heartbeat is not None for name in NAMES)
    assert (nodes["b"].memory_gb, nodes["c"].memory_gb) == (12, 16), "a heartbeat posted during the outage was lost"
    replica.refresh_from_db()
    assert (replica.state, replica.endpoint) == ("ready", "http://127.0.0.1:9/v1")
    assert not collections_broker.exists(*node.node_keys(collections_broker, *NAMES))


class StopsPostgresAfterItsFirstScript:
    """The control plane's Redis, but PostgreSQL is stopped right after the first script it runs:
    record_report's claim of the report's number, between its read of the replica and its save."""

    def __init__(self, client):
        self.client = client
        self.scripts = 0

    def eval(self, *args):
        answer = self.client.eval(*args)
        self.scripts += 1
        if self.scripts == 1:
            stop_postgres()
        return answer

    def __getattr__(self, name):
        return getattr(self.client, name)


def test_a_report_whose_save_met_the_database_away_is_applied_once_it_is_back(collections_broker, monkeypatch, caplog):
    issue_token("a")
    replica = Replica.objects.create(model_name="m", profile_name="cpu", node=Node.objects.get(name="a"))
    node.post_report(
        collections_broker, "a", replica.pk, node.report("a", replica.pk, "ready", "http://127.0.0.1:9/v1")
    )
    real = reports.redis_client()
    away = StopsPostgresAfterItsFirstScript(real)
    monkeypatch.setattr(reports, "redis_client", lambda: away)
    try:
        fleet_tasks.collect()
        assert away.scripts >= 1, "the report was never claimed: the database went away elsewhere"
        assert "collecting waits for the database" in caplog.text
    finally:
        start_postgres()
    monkeypatch.setattr(reports, "redis_client", lambda: real)
    fleet_tasks.collect()
    replica.refresh_from_db()
    # Before: the report's number was set before the save, so once back it was "older than one already applied".
    assert (replica.state, replica.endpoint) == ("ready", "http://127.0.0.1:9/v1"), caplog.text[-2000:]


def test_a_replica_that_failed_while_the_database_was_away_is_started_again_once_it_is_back(collections_broker, caplog):
    add_node("a")
    add_served_model("tiny", scaling_min=1, scaling_max=1)
    reconcile.reconcile()
    replica = Replica.objects.get()
    replica.enter(Replica.State.READY, "", "http://127.0.0.1:9/v1")
    replica.save()
    sent(collections_broker, "node.a")  # its start, sent before the outage
    # Signed before the outage (the test reads the node's key from the database); posted during it.
    died = node.report("a", replica.pk, "stopped", "", "the engine exited with code 1")
    stop_postgres()
    try:
        node.post_report(collections_broker, "a", replica.pk, died)
        fleet_tasks.reconcile()  # the beat's pass: collecting and placing both wait
        assert "reconcile waits for the database" in caplog.text
    finally:
        start_postgres()
    fleet_tasks.reconcile()
    replica.refresh_from_db()
    assert (replica.state, replica.attempts) == ("failed", 1), "the failure posted during the outage was lost"
    reconcile.reconcile(now=replica.since + reconcile.retry_delay(1))
    replica.refresh_from_db()
    assert replica.state == "pending" and replica.reason.startswith("starting again after: the engine exited")
    assert [(task, args[0]) for task, args, *_ in sent(collections_broker, "node.a")] == [
        (tasks.START_REPLICA, replica.pk)
    ]
