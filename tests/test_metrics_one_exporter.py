"""The fleet's gauges come from the admin server alone, and a gateway's /metrics answers while PostgreSQL is away
(issue 41 item 7). Real processes: `manage.py admin_server` and `manage.py gateway`, the gateway's database reached
through a relay that the test cuts, so only that gateway loses PostgreSQL.
"""

from __future__ import annotations

import pytest
import requests
from django.conf import settings
from prometheus_client.parser import text_string_to_metric_families

from .support import processes as started_processes
from .support.factories import add_model, add_node
from .support.gateway_process import start_gateway
from .support.processes import start_admin_server, wait_until
from .support.tcp_relay import TcpRelay

pytestmark = pytest.mark.django_db(transaction=True)

TOKEN = "a-scrapers-token-of-some-length"
FLEET_FAMILIES = ("llmgw_nodes", "llmgw_node_memory_gb", "llmgw_replicas")


def scrape(url: str) -> requests.Response:
    return requests.get(url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)


def families(text: str) -> set[str]:
    return {family.name for family in text_string_to_metric_families(text)}


def test_the_fleets_gauges_are_the_admin_servers_alone_and_a_gateway_scrapes_while_postgresql_is_away(
    tmp_path, processes
):
    add_model("chat")
    add_node("gpu-1")
    db = settings.DATABASES["default"]
    if db["ENGINE"] != "django.db.backends.postgresql":
        pytest.skip("the relay stands in front of PostgreSQL")
    relay = TcpRelay((db["HOST"] or "127.0.0.1", int(db["PORT"])))
    through_relay = started_processes.test_database_url().replace(f":{db['PORT']}/", f":{relay.port}/")
    admin, admin_url = start_admin_server(tmp_path, LLMGW_METRICS_TOKEN=TOKEN)
    gateway, gateway_url = start_gateway(tmp_path, LLMGW_METRICS_TOKEN=TOKEN, DATABASE_URL=through_relay)
    processes += [admin, gateway]

    from_admin, from_gateway = scrape(admin_url), scrape(gateway_url)
    assert from_admin.status_code == 200 and from_gateway.status_code == 200
    for family in FLEET_FAMILIES:
        assert family in families(from_admin.text), family
        assert family not in families(from_gateway.text), f"{family} exported by a gateway too"
    assert "llmgw_gateway_requests" in families(from_gateway.text)

    relay.cut()
    wait_until(
        lambda: requests.get(gateway_url + "/healthz", timeout=10).json()["checks"]["database"]["ok"] is False,
        # Generous: it only bounds a failure (20 s ran out once in a CI run at load, 2026-12-05).
        timeout=60,
        what="the gateway to notice its database is away",
    )
    away = scrape(gateway_url)
    assert away.status_code == 200, away.text
    assert "llmgw_gateway_requests" in families(away.text)
