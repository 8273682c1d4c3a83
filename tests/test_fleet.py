"""The fleet from the control plane's side: enrolment tokens, heartbeats through a real worker, and the API."""

import re
import subprocess
import sys
from datetime import timedelta

import pytest
from celery import current_app
from django.core.management import call_command
from django.core.management.base import CommandError
from django.utils import timezone

from contracts import signing
from fleet.enrolment import node_for_token
from fleet.models import Node

from .staff_api import token_session
from .support.processes import BASE_DIR, process_env
from .support.waiting import wait_until

TOKEN = re.compile(r"llmgw-node-[A-Za-z0-9_-]{40,}")


def node_token(name: str) -> str:
    done = subprocess.run(
        [sys.executable, "manage.py", "node_token", name],
        cwd=BASE_DIR,
        env=process_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.django_db(transaction=True)
def test_node_token_prints_a_fresh_token_and_the_old_one_stops_working():
    first = node_token("gpu-01")
    assert TOKEN.fullmatch(first)
    assert node_for_token(first).name == "gpu-01"
    second = node_token("gpu-01")
    assert second != first
    assert node_for_token(first) is None
    assert node_for_token(second).name == "gpu-01"
    # Only the hash is kept.
    assert first not in str(Node.objects.values().get())


@pytest.mark.django_db
def test_node_token_refuses_a_name_that_is_not_one():
    with pytest.raises(CommandError, match="'../etc' is not a node name: use up to 100 letters"):
        call_command("node_token", "../etc")
    assert not Node.objects.exists()


FACTS = {
    "node": "gpu-01",
    "engines": ["llamacpp", "vllm"],
    "gpus": [{"name": "L4", "memory_mb": 23034}],
    "memory_gb": 62,
    "disk_free_bytes": 500 * 10**9,
    "agent_version": "0.1.0",
    "labels": {"size": "large"},
}


def heartbeat(name: str, token: str, facts: dict) -> None:
    """A heartbeat as a message of its own, signed as an agent signs it with the key of `token`."""
    message = signing.sign_message(signing.token_hash(token), "fleet.heartbeat", name, facts)
    current_app.send_task("fleet.heartbeat", args=[message], queue="control")


@pytest.mark.django_db(transaction=True)
def test_a_heartbeat_signed_with_the_nodes_token_upserts_it_through_the_control_queue(control_worker):
    token = node_token("gpu-01")
    heartbeat("gpu-01", token, FACTS)
    node = wait_until(
        lambda: Node.objects.filter(name="gpu-01", last_heartbeat__isnull=False).first(), what="the heartbeat"
    )
    assert (node.engines, node.memory_gb, node.labels, node.gpu_total) == (
        ["llamacpp", "vllm"],
        62,
        {"size": "large"},
        1,
    )
    assert node.state == Node.State.READY


@pytest.mark.django_db(transaction=True)
def test_a_stray_worker_cannot_enrol_itself_or_speak_for_another_node(control_worker):
    other = node_token("cpu-01")
    heartbeat("stray", "llmgw-node-made-up", {**FACTS, "node": "stray"})
    heartbeat("gpu-01", other, FACTS)  # signed with cpu-01's token, claiming to be gpu-01
    wait_until(lambda: control_worker.output().count("heartbeat of node") >= 2, what="both to be refused")
    assert list(Node.objects.values_list("name", "last_heartbeat")) == [("cpu-01", None)]


@pytest.mark.django_db(transaction=True)
def test_the_fleet_api_lists_nodes_with_their_state_and_never_a_token_hash(live_server):
    Node.objects.create(
        name="a", last_heartbeat=timezone.now(), memory_gb=16, engines=["llamacpp"], token_hash="f" * 64
    )
    Node.objects.create(name="b", last_heartbeat=timezone.now() - timedelta(hours=1))
    Node.objects.create(name="c", last_heartbeat=timezone.now(), draining=True)
    body = token_session().get(live_server.url + "/api/fleet/nodes/").json()
    states = {n["name"]: (n["state"], n["enrolled"]) for n in body["results"]}
    assert states == {"a": ("ready", True), "b": ("not_ready", False), "c": ("draining", False)}
    assert "token_hash" not in body["results"][0] and "f" * 64 not in str(body)


@pytest.mark.django_db(transaction=True)
def test_staff_drain_a_node_through_the_api_and_nothing_else(live_server):
    node = Node.objects.create(name="a", memory_gb=16)
    api, url = token_session(), f"{live_server.url}/api/fleet/nodes/{node.pk}/"
    assert api.patch(url, json={"draining": True}).json()["state"] == "draining"
    refused = api.patch(url, json={"memory_gb": 512, "draining": False})
    assert refused.status_code == 400
    assert "only draining can be set here; memory_gb comes from the node's heartbeats" in str(refused.json())
    node.refresh_from_db()
    assert (node.draining, node.memory_gb) == (True, 16)
    assert api.delete(url).status_code == 405
