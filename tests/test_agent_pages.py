"""What staff see of fetches: the API, the fleet page, the version page, and asking and cancelling in the admin."""

import json

import pytest

from agent import progress
from contracts import progress as contracts_progress
from fleet.models import Fetch, Node
from mirror.models import MirrorVersion

pytestmark = pytest.mark.django_db(transaction=True)

SOURCE = "http://mirror:8001/m/v1/"


@pytest.fixture
def redis_for_n1(redis_client):
    """The tests' Redis, with node n1's task queue gone after the test too."""
    yield redis_client
    redis_client.delete("node.n1")


@pytest.fixture
def node():
    return Node.objects.create(name="n1")


def publish(client, node="n1", source=SOURCE, done=500, total=2000, state="fetching"):
    live = progress.RedisProgress(client, source, node)
    live.begin(bytes_total=total, files_total=4, bytes_done=done, files_done=1)
    live.file_started("model-00002-of-00004.gguf")
    if state == "failed":
        live.failed("http://mirror:8001/m/v1/ holds no files")
    return live


def test_the_progress_api_gives_each_nodes_progress_on_a_source(admin_client, redis_for_n1):
    # Progress is read for the enrolled nodes, each under its own prefix.
    Node.objects.create(name="n1")
    Node.objects.create(name="n2")
    publish(redis_for_n1)
    publish(redis_for_n1, node="n2", done=2000, state="fetching")
    body = admin_client.get("/api/progress/", {"source": SOURCE}).json()
    assert body["source"] == SOURCE
    by_node = {n["node"]: n for n in body["nodes"]}
    assert by_node["n1"]["bytes_done"] == 500 and by_node["n1"]["bytes_total"] == 2000
    assert by_node["n1"]["files_done"] == 1 and by_node["n1"]["files_total"] == 4
    assert by_node["n1"]["current_file"] == "model-00002-of-00004.gguf"
    assert by_node["n1"]["state"] == "fetching"
    assert by_node["n2"]["bytes_done"] == 2000


def test_the_progress_api_asks_for_a_source_and_is_for_staff(client, admin_client, redis_for_n1):
    assert admin_client.get("/api/progress/").status_code == 400
    assert client.get("/api/progress/", {"source": SOURCE}).status_code in (401, 403)


def test_progress_is_published_a_few_times_a_second_at_most(redis_for_n1):
    live = progress.RedisProgress(redis_for_n1, SOURCE, "n1")
    live.begin(bytes_total=10**9, files_total=1)
    published = []
    original = live.send
    live.send = lambda snapshot: (published.append(snapshot), original(snapshot))
    for _ in range(20_000):
        live.advanced(1)
    assert len(published) <= 5  # 20,000 updates in well under a second
    assert contracts_progress.read_one(redis_for_n1, "n1", SOURCE)["bytes_done"] <= 20_000


def test_the_fleet_page_shows_each_nodes_fetches_and_its_fragment_refreshes(admin_client, redis_for_n1, node):
    publish(redis_for_n1)
    Fetch.objects.create(node=node, source="http://mirror:8001/old/v1/", state="failed", error="the disk is full")
    page = admin_client.get("/fleet/fetches/")
    html = page.content.decode()
    assert page.status_code == 200
    assert 'hx-get="/fleet/fetches/"' in html and "htmx" in html
    assert "<h2>n1</h2>" in html
    assert SOURCE in html and "25.0%" in html and "model-00002-of-00004.gguf" in html
    assert "http://mirror:8001/old/v1/" in html and "the disk is full" in html
    fragment = admin_client.get("/fleet/fetches/", HTTP_HX_REQUEST="true").content.decode()
    assert "<html" not in fragment and SOURCE in fragment


def test_the_fetch_records_link_to_the_live_page(admin_client):
    assert 'href="/fleet/fetches/"' in admin_client.get("/admin/fleet/fetch/").content.decode()


def test_the_fleet_page_is_for_staff(client):
    assert client.get("/fleet/fetches/").status_code == 302


def test_the_mirror_version_page_follows_that_versions_progress(admin_client, redis_for_n1, settings, node):
    settings.BYTES_URL = "http://mirror:8001/"
    from django.utils import timezone

    version = MirrorVersion.objects.create(model="m", version="v1", scanned_at=timezone.now())
    html = admin_client.get(f"/admin/mirror/mirrorversion/{version.pk}/change/").content.decode()
    assert 'hx-get="/fleet/progress/?source=http%3A%2F%2Fmirror%3A8001%2Fm%2Fv1%2F"' in html
    publish(redis_for_n1, state="failed")
    fragment = admin_client.get("/fleet/progress/", {"source": SOURCE}).content.decode()
    assert "n1" in fragment and "failed" in fragment and "holds no files" in fragment


def test_staff_ask_a_node_for_a_fetch_and_the_task_waits_on_its_queue(admin_client, redis_for_n1, node):
    response = admin_client.post("/admin/fleet/fetch/add/", {"node": node.pk, "source": SOURCE})
    assert response.status_code == 302
    fetch = Fetch.objects.get(node=node, source=SOURCE)
    assert fetch.state == "requested" and fetch.requested_by.username == "admin"
    queued = [json.loads(m) for m in redis_for_n1.lrange("node.n1", 0, -1)]
    assert [(m["headers"]["task"], m["headers"]["id"]) for m in queued] == [("agent.fetch", fetch.task_id)]
    # Asking again is a new request of the same row, not a second row.
    admin_client.post("/admin/fleet/fetch/add/", {"node": node.pk, "source": SOURCE})
    assert Fetch.objects.filter(node=node, source=SOURCE).count() == 1
    assert redis_for_n1.llen("node.n1") == 2


def test_asking_for_an_unsafe_source_says_why_and_sends_nothing(admin_client, redis_for_n1, node):
    response = admin_client.post(
        "/admin/fleet/fetch/add/", {"node": node.pk, "source": "http://mirror:8001/m/%2e%2e/%2e%2e/etc/"}
    )
    assert response.status_code == 200
    assert "refused rather than cached" in response.content.decode()
    assert not Fetch.objects.exists()
    assert redis_for_n1.llen("node.n1") == 0


def test_staff_cancel_a_fetch_and_the_node_finds_the_flag(admin_client, redis_for_n1, node):
    admin_client.post("/admin/fleet/fetch/add/", {"node": node.pk, "source": SOURCE})
    fetch = Fetch.objects.get()
    response = admin_client.post(
        "/admin/fleet/fetch/", {"action": "cancel", "_selected_action": [fetch.pk]}, follow=True
    )
    assert "Cancelled 1 fetch(es)." in response.content.decode()
    fetch.refresh_from_db()
    assert fetch.state == "cancelled"
    assert redis_for_n1.exists(contracts_progress.cancel_key("n1", SOURCE))
    live = progress.RedisProgress(redis_for_n1, SOURCE, "n1")
    with pytest.raises(progress.Cancelled):
        live.begin(bytes_total=10, files_total=1)


def test_a_report_from_a_node_is_recorded_only_with_its_signature(node):
    from contracts import signing
    from fleet.enrolment import issue_token
    from fleet.tasks import fetch_finished

    token = issue_token("n1")
    issue_token("n2")
    report = {"node": "n1", "source": SOURCE, "state": "complete", "path": "/c/m/v1", "bytes_total": 10}

    def signed(body, name="n1", key=signing.token_hash(token)):
        return signing.sign_message(key, "agent.fetch_finished", name, body)

    fetch_finished(signed(report, key=signing.token_hash("llmgw-node-wrong")))
    assert not Fetch.objects.exists()
    fetch_finished(signed(dict(report, node="n2")))
    fetch_finished(signed(dict(report, node="n2"), name="n2"))  # n1's key on a message naming n2
    fetch_finished(token, report)  # the old form: the raw token first
    assert not Fetch.objects.exists()
    fetch_finished(signed(report))
    fetch = Fetch.objects.get()
    assert (fetch.state, fetch.path, fetch.bytes_total) == ("complete", "/c/m/v1", 10)
    fetch_finished(signed(report))  # delivered twice: still one record
    assert Fetch.objects.count() == 1
