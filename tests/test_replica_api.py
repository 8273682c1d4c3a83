"""Replicas as staff see them: the API and the admin list, with the reason a replica is pending."""

import pytest
from django.contrib.auth.models import User
from rest_framework.test import APIClient

from accounts import tokens
from fleet.enrolment import issue_token
from fleet.models import Node, Replica

pytestmark = pytest.mark.django_db

WHY = "cpu-1: 7 GB free, needs 8; gpu-2: no llamacpp"


@pytest.fixture
def replica_rows():
    """Two rows: a ready replica of tiny on node a, and a pending one of big that says why."""
    a = Node.objects.create(name="a")
    ready = Replica.objects.create(
        model_name="tiny", profile_name="cpu", node=a, state="ready", endpoint="http://a:9000/v1"
    )
    pending = Replica.objects.create(model_name="big", profile_name="cpu", reason=WHY)
    return ready, pending


@pytest.fixture
def staff():
    user = User.objects.create_user("staff", password="pw", is_staff=True, is_superuser=True)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Token " + tokens.issue(user))
    return client


def test_staff_see_where_replicas_run_and_why_one_does_not(staff, replica_rows):
    body = staff.get("/api/fleet/replicas/").json()
    rows = {r["model"]: r for r in body["results"]}
    assert rows["tiny"]["node"] == "a" and rows["tiny"]["endpoint"] == "http://a:9000/v1"
    assert rows["big"]["node"] is None and rows["big"]["state"] == "pending"
    assert rows["big"]["reason"] == WHY


def test_replicas_filter_by_model_node_and_state(staff, replica_rows):
    assert [r["model"] for r in staff.get("/api/fleet/replicas/?state=pending").json()["results"]] == ["big"]
    assert [r["model"] for r in staff.get("/api/fleet/replicas/?node=a").json()["results"]] == ["tiny"]
    assert [r["model"] for r in staff.get("/api/fleet/replicas/?model=tiny").json()["results"]] == ["tiny"]


def test_anonymous_callers_and_node_tokens_are_refused(replica_rows):
    assert APIClient().get("/api/fleet/replicas/").status_code in (401, 403)
    node_client = APIClient()
    node_client.credentials(HTTP_AUTHORIZATION="Token " + issue_token("a"))
    assert node_client.get("/api/fleet/replicas/").status_code in (401, 403)


def test_clients_cannot_write_replicas(staff, replica_rows):
    ready, _ = replica_rows
    assert staff.post("/api/fleet/replicas/", {"model": "x"}).status_code == 405
    assert staff.delete(f"/api/fleet/replicas/{ready.pk}/").status_code == 405


def test_the_admin_lists_the_reason_and_replaces_on_request(client, replica_rows, django_capture_on_commit_callbacks):
    ready, pending = replica_rows
    User.objects.create_superuser("boss", password="pw")
    client.login(username="boss", password="pw")
    page = client.get("/admin/fleet/replica/").content.decode()
    assert "7 GB free, needs 8" in page
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        client.post(
            "/admin/fleet/replica/", {"action": "replace", "_selected_action": [ready.pk, pending.pk]}, follow=True
        )
    sent = len(callbacks)
    ready.refresh_from_db()
    assert ready.state == "stopping" and ready.reason == "stopped by boss"
    assert not Replica.objects.filter(pk=pending.pk).exists()
    assert sent == 1
