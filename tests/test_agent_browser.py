"""Fetch progress in a real browser: the pages follow Redis through htmx without a reload."""

import pytest
from django.utils import timezone

from agent import progress
from fleet.models import Node
from mirror.models import MirrorVersion

from .staff_browser import screenshot

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

SOURCE = "http://127.0.0.1:8001/m/v1/"


@pytest.fixture(autouse=True)
def enrolled_n1(db):
    """The pages believe a node's progress only for an enrolled node (readers ask enrolled nodes' keys)."""
    return Node.objects.create(name="n1")


def publish(client, done: int, state: str = "fetching") -> None:
    live = progress.RedisProgress(client, SOURCE, "n1")
    live.begin(bytes_total=4000, files_total=4, bytes_done=done, files_done=done // 1000)
    if state == "complete":
        live.complete()


def test_the_version_page_shows_the_fetch_moving_without_a_reload(staff_page, live_server, redis_client, settings):
    settings.BYTES_URL = "http://127.0.0.1:8001/"
    version = MirrorVersion.objects.create(model="m", version="v1", scanned_at=timezone.now())
    publish(redis_client, 1000)
    staff_page.goto(f"{live_server.url}/admin/mirror/mirrorversion/{version.pk}/change/")
    row = staff_page.locator("#version-progress tr[data-node=n1]")
    row.wait_for()
    assert "25.0%" in row.inner_text()
    publish(redis_client, 3000)
    staff_page.wait_for_function(
        "document.querySelector('#version-progress tr[data-node=n1]').innerText.includes('75.0%')", timeout=10_000
    )
    publish(redis_client, 4000, state="complete")
    staff_page.locator("#version-progress tr[data-node=n1][data-state=complete]").wait_for(timeout=10_000)
    screenshot(staff_page, "agent-version-progress")


def test_the_fleet_page_follows_each_node_without_a_reload(staff_page, live_server, redis_client):
    publish(redis_client, 1000)
    staff_page.goto(f"{live_server.url}/fleet/fetches/")
    row = staff_page.locator(f"#fleet-fetches tr[data-source='{SOURCE}']")
    row.wait_for()
    assert "fetching" in row.inner_text()
    publish(redis_client, 4000, state="complete")
    staff_page.locator(f"#fleet-fetches tr[data-source='{SOURCE}'][data-state=complete]").wait_for(timeout=10_000)
    assert "100.0%" in row.inner_text()
    screenshot(staff_page, "agent-fleet-fetches")
