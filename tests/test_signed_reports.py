"""Issue 33, items 1, 2, 6/7: what a node says is signed by the node, never carries its token,
says where its engines are only within its enrolment, and cannot stop the collection.

Real: Redis (its MONITOR read by `redis-cli`), PostgreSQL, the control plane's Celery worker,
`manage.py agent` for n1 with its supervisor, and llama.cpp on the tiny model. The attacker is a
Redis client that knows node names and whatever it reads off the broker, as every node,
gateway host and engine could before.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import re
import subprocess
import time
from datetime import timedelta

import pytest
from celery import current_app
from django.conf import settings
from django.utils import timezone

from agent import engine_state, engines
from contracts import keys, signing, tasks
from fleet import reconcile as reconciling
from fleet import tasks as fleet_tasks
from fleet.enrolment import issue_token
from fleet.models import Fetch, Node, Replica
from fleet.tasks import collect, replica_report
from launcher.demo_model import write_tiny_llama

from .support import node_messages as as_node
from .support.factories import add_served_model
from .support.mirror import put
from .support.processes import start_agent, start_celery_worker
from .support.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

FACTS = {"engines": ["llamacpp"], "gpus": [], "memory_gb": 8, "disk_free_bytes": 10**9, "labels": {}}


def a_replica(node: str = "n1", state: str = Replica.State.STARTING) -> Replica:
    return Replica.objects.create(model_name="m", profile_name="cpu", node=Node.objects.get(name=node), state=state)


def old_form(task: str, *args, **kwargs) -> None:
    """A task as agents before issue 33 sent it, the raw token first."""
    current_app.send_task(task, args=list(args), kwargs=kwargs, queue=tasks.CONTROL_QUEUE)


# --- a Redis client that is not the node -----------------------------------------------------


@pytest.fixture
def n1_heard_and_a_worker(broker, mirror_root, tmp_path):
    """n1 enrolled and heard 10 s ago, its replica starting; then a real control worker, started after
    the passes that enrolling n1 asked for are taken off its queue (they would stop a replica of no
    catalog model, which is not what these tests are about)."""
    issue_token("n1")
    heard = timezone.now() - timedelta(seconds=10)
    Node.objects.filter(name="n1").update(last_heartbeat=heard, engines=["llamacpp"], memory_gb=8)
    replica = a_replica()
    broker.delete(tasks.CONTROL_QUEUE)
    worker = start_celery_worker("control", "control", tmp_path, LLMGW_MIRROR_ROOT=mirror_root)
    yield worker, replica, heard
    worker.stop()


def test_a_redis_client_that_is_not_the_node_cannot_make_a_heartbeat_report_or_fetch_report_accepted(
    n1_heard_and_a_worker, broker
):
    control_worker, replica, heard = n1_heard_and_a_worker
    endpoint = "http://127.0.0.1:9000/v1"
    made_up = "llmgw-node-made-up"  # knowing the name only, the forger signs with a key of its own
    fetch = {"node": "n1", "source": "http://127.0.0.1:1/m/v1/", "state": "complete", "path": "/x", "bytes_total": 1}

    as_node.post_heartbeat(broker, "n1", as_node.heartbeat("n1", dict(FACTS, memory_gb=99), token=made_up))
    as_node.post_report(broker, "n1", replica.pk, as_node.report("n1", replica.pk, "ready", endpoint, token=made_up))
    current_app.send_task(
        tasks.FETCH_FINISHED, args=[as_node.fetch_report("n1", fetch, token=made_up)], queue=tasks.CONTROL_QUEUE
    )
    # A genuine message of n1 (as read off the broker) with its body changed: ready, somewhere else.
    genuine = as_node.report("n1", replica.pk, "failed", "", "out of memory")
    current_app.send_task(
        tasks.REPLICA_REPORT,
        args=[dict(genuine, body=dict(genuine["body"], state="ready", endpoint=endpoint))],
        queue=tasks.CONTROL_QUEUE,
    )
    # The old form, with a token that is not n1's: as a task, and posted where old agents posted.
    old_form(tasks.HEARTBEAT, made_up, dict(FACTS, node="n1"))
    old_form(tasks.REPLICA_REPORT, made_up, replica.pk, "ready", endpoint, "", seq=1)
    old_form(tasks.FETCH_FINISHED, made_up, fetch)
    broker.hset(tasks.OLD_HEARTBEATS_KEY, "n1", json.dumps([made_up, dict(FACTS, node="n1")]))

    def refused() -> bool:
        out = control_worker.output()
        return out.count("refused: its signature does not match") >= 4 and out.count("old form") >= 4

    wait_until(refused, timeout=60, what=f"every forgery to be refused\n{control_worker.output()[-3000:]}")
    node = Node.objects.get(name="n1")
    assert (node.last_heartbeat, node.memory_gb) == (heard, 8)
    replica.refresh_from_db()
    assert (replica.state, replica.endpoint, replica.attempts) == ("starting", "", 0)
    assert not Fetch.objects.exists()
    # And what n1 itself signs is taken: the refusals above are not of everything.
    as_node.post_heartbeat(broker, "n1", as_node.heartbeat("n1", dict(FACTS, memory_gb=9)))
    wait_until(lambda: Node.objects.get(name="n1").memory_gb == 9, timeout=30, what="n1's own heartbeat")


def _secrets_in(text: str, secrets: list[str]) -> list[str]:
    """Which of `secrets` appear in the text, as they are or inside base64 (Celery's message bodies)."""
    found = [s for s in secrets if s in text]
    for run in re.findall(r"[A-Za-z0-9+/]{24,}={0,2}", text):
        try:
            decoded = base64.b64decode(run + "=" * (-len(run) % 4)).decode(errors="replace")
        except (binascii.Error, ValueError):
            continue
        found += [s for s in secrets if s in decoded and s not in found]
    return found


@pytest.mark.engine
def test_the_broker_carries_no_token_while_a_real_agent_heartbeats_reports_and_fetches(
    control_worker, enrolled_node, byte_listener, mirror_root, agent_cache, tmp_path
):
    """Captured: every command Redis received (MONITOR, as any client with the broker's password could
    run it before issue 33's ACLs) from before n1's agent started until each kind of message it sends
    had crossed at least once: heartbeats (posted each second), the replica's reports as tasks
    (starting, ready), the fetch report of its weights, and the supervisor's repeat of the replica's
    state, posted a minute after its last report: over 60 s of the node's traffic."""
    name, token = enrolled_node
    capture = tmp_path / "monitor.txt"
    with capture.open("w") as out:
        monitor = subprocess.Popen(["redis-cli", "-u", settings.REDIS_URL, "monitor"], stdout=out)
    try:
        wait_until(lambda: capture.read_text().startswith("OK"), timeout=10, what="redis-cli monitor")
        write_tiny_llama(tmp_path / "gguf")
        put(mirror_root, "tiny", "v1", {p.name: p.read_bytes() for p in (tmp_path / "gguf").glob("*.gguf")})
        source = byte_listener + "tiny/v1/"
        replica = Replica.objects.create(
            model_name="tiny",
            profile_name="cpu",
            node=Node.objects.get(name=name),
            source=source,
            engine="llamacpp",
            args=["--ctx-size", "256"],
        )
        agent = start_agent(name, token, agent_cache, tmp_path, LLMGW_BYTES_URL=byte_listener)
        try:
            reconciling.send_start(replica)

            def every_kind_crossed() -> bool:
                said = capture.read_text()
                return (
                    Replica.objects.filter(pk=replica.pk, state="ready").exists()
                    and Fetch.objects.filter(source=source, state="complete").exists()
                    and Node.objects.filter(name=name, last_heartbeat__isnull=False).exists()
                    and f'"HSET" "{keys.reports_key(name)}"' in said
                )

            wait_until(every_kind_crossed, timeout=300, interval=1, what=f"every kind\n{agent.output()[-3000:]}")
        finally:
            agent.stop()
            for entry in engine_state.read_state(agent_cache)["replicas"].values():
                if entry.get("pid") and engines.group_alive(entry["pid"]):
                    engines.stop_group(entry["pid"], grace=3)
    finally:
        monitor.terminate()
        monitor.wait(timeout=10)
    said = capture.read_text()
    # Each kind as the node sent it (the control plane's own reads of the keys do not count).
    for kind in (f'"SET" "{keys.heartbeat_key(name)}"', tasks.REPLICA_REPORT, tasks.FETCH_FINISHED):
        assert kind in said
    key = signing.token_hash(token)
    assert _secrets_in(said, [token, key]) == []
    assert Replica.objects.get(pk=replica.pk).endpoint.startswith("http://127.0.0.1:")


# --- the control plane decides where an engine is --------------------------------------------


@pytest.mark.parametrize(
    "endpoint",
    [
        "http://203.0.113.9:9000/v1",  # another host
        "http://10.0.0.5:9000/v1/../../admin",  # a path
        "http://10.0.0.5:9000/",  # another path
        "http://user:pw@10.0.0.5:9000/v1",  # userinfo
        "http://10.0.0.5@203.0.113.9:9000/v1",  # userinfo that looks like the host
        "http://10.0.0.5:9000/v1?x=1",  # a query
        "https://10.0.0.5:9000/v1",  # another scheme
        "http://10.0.0.5:0/v1",  # no port
        "http://10.0.0.5:99999/v1",  # no port either
    ],
)
def test_a_ready_report_at_an_endpoint_the_enrolment_does_not_allow_is_refused_with_a_sentence(broker, endpoint):
    issue_token("n1", address="10.0.0.5")
    replica = a_replica()
    replica_report(as_node.report("n1", replica.pk, "ready", endpoint))
    replica.refresh_from_db()
    assert (replica.state, replica.endpoint) == ("failed", "")
    assert replica.reason.startswith("Not routed to: its node reported it at")
    assert "node n1 is enrolled at 10.0.0.5" in replica.reason and "http://10.0.0.5:PORT/v1" in replica.reason


def test_a_ready_report_at_the_enrolled_address_is_routed_and_a_node_without_one_only_on_loopback(broker):
    issue_token("n1", address="10.0.0.5")
    issue_token("n2")
    on_n1, on_n2, elsewhere = a_replica("n1"), a_replica("n2"), a_replica("n2")
    replica_report(as_node.report("n1", on_n1.pk, "ready", "http://10.0.0.5:9000/v1"))
    replica_report(as_node.report("n2", on_n2.pk, "ready", "http://127.0.0.1:9001/v1"))
    replica_report(as_node.report("n2", elsewhere.pk, "ready", "http://10.0.0.5:9000/v1"))
    states = dict(Replica.objects.values_list("pk", "state"))
    assert (states[on_n1.pk], states[on_n2.pk], states[elsewhere.pk]) == ("ready", "ready", "failed")
    assert "without an address, so on this host only" in Replica.objects.get(pk=elsewhere.pk).reason


def test_a_replica_routed_before_at_a_forged_endpoint_is_taken_out_by_its_next_report(broker):
    issue_token("n1")
    replica = a_replica(state=Replica.State.READY)
    Replica.objects.filter(pk=replica.pk).update(endpoint="http://203.0.113.9/v1")
    # The repeat of the same forged endpoint is not "as before": it is checked first.
    replica_report(as_node.report("n1", replica.pk, "ready", "http://203.0.113.9/v1"))
    replica.refresh_from_db()
    assert (replica.state, replica.endpoint) == ("failed", "")


# --- the sequence is bounded by what the node could have sent --------------------------------


def test_a_forged_sequence_number_no_longer_makes_genuine_later_reports_look_old(broker, caplog):
    issue_token("n1")
    replica = a_replica()
    # Signed by the node itself, even: 1e15 as the issue's forger sent it, and numbers from the future.
    replica_report(as_node.report("n1", replica.pk, "failed", "", "forged", seq=10**15))
    replica_report(as_node.report("n1", replica.pk, "failed", "", "forged", seq=10**18))
    replica_report(as_node.report("n1", replica.pk, "failed", "", "forged", seq=int((time.time() + 3600) * 1e6)))
    assert caplog.text.count("is not a time the node could have signed it at") == 2
    # And one left in Redis before the bound (an attack made on the old code) is forgotten.
    broker.set(f"llmgw:applied-report-seq:n1:{replica.pk}", 10**18)
    replica_report(as_node.report("n1", replica.pk, "ready", "http://127.0.0.1:9000/v1"))
    replica.refresh_from_db()
    assert (replica.state, replica.endpoint) == ("ready", "http://127.0.0.1:9000/v1")
    # The order still holds among genuine reports: one signed earlier, delivered late, is ignored.
    late = as_node.report("n1", replica.pk, "starting", seq=int((time.time() - 5) * 1e6))
    replica_report(late)
    assert Replica.objects.get(pk=replica.pk).state == "ready"


def test_a_message_that_expired_or_lives_longer_than_a_node_signs_for_is_refused(broker, caplog):
    issue_token("n1")
    replica = a_replica()
    replica_report(as_node.report("n1", replica.pk, "ready", "http://127.0.0.1:9000/v1", now=time.time() - 3600))
    key = Node.objects.get(name="n1").token_hash
    body = {"replica": replica.pk, "state": "ready", "endpoint": "http://127.0.0.1:9000/v1", "reason": ""}
    lasting = signing.sign_message(key, tasks.REPLICA_REPORT, "n1", body, now=time.time() + 3000, seq=1)
    replica_report(lasting)
    assert "it expired at" in caplog.text and "later than a node signs for" in caplog.text
    assert Replica.objects.get(pk=replica.pk).state == "starting"


# --- collection survives bad input -----------------------------------------------------------

BAD = {
    "word": {"memory_gb": "x"},  # int("x") raised
    "huge": {"memory_gb": 2**40},  # PostgreSQL: integer out of range
    "nul": {"agent_version": "1.0\x00"},  # PostgreSQL: no NUL in text
    "listed": {"disk_free_bytes": [1, 2]},  # a list where a number goes
    "deep": {"labels": {"zone": {"a": 1}}},
    "replicas": {"replicas": ["1"]},
}


def test_a_bad_heartbeat_loses_nobody_elses_and_reconcile_still_runs(broker, caplog):
    caplog.set_level(logging.WARNING, logger="fleet.tasks")
    for name in ("good-a", "good-b", *BAD):
        issue_token(name)
    for name, facts in BAD.items():
        as_node.post_heartbeat(broker, name, as_node.heartbeat(name, dict(FACTS, **facts)))
    for name in ("good-a", "good-b"):
        as_node.post_heartbeat(broker, name, as_node.heartbeat(name, FACTS))
    # Not even JSON, and a report of one field wrong, in the same batch.
    as_node.post_report(broker, "word", 1, "{not json")
    add_served_model("tiny", memory_gb=1)

    fleet_tasks.reconcile()  # collects first, as on every beat

    heard = dict(Node.objects.values_list("name", "last_heartbeat"))
    assert heard["good-a"] and heard["good-b"]
    assert not any(heard[name] for name in BAD)
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    for name, facts in BAD.items():
        [line] = [line for line in lines if line.startswith(f"heartbeat of node {name} refused")]
        assert next(iter(facts)) in line
    assert any(line.startswith("replica report of node word refused: it is not JSON") for line in lines)
    # The pass went on and placed the model on a node that was heard.
    assert Replica.objects.get(model_name="tiny").node.name in ("good-a", "good-b")


def test_reconcile_runs_when_collection_itself_fails(broker, monkeypatch, caplog):
    issue_token("good-a")
    as_node.post_heartbeat(broker, "good-a", as_node.heartbeat("good-a", FACTS))
    collect()  # heard once
    add_served_model("tiny", memory_gb=1)

    def broken(*args):
        raise ConnectionError("Redis went away")

    monkeypatch.setattr(tasks, "take", broken)
    fleet_tasks.reconcile()
    assert "collecting what the nodes posted failed" in caplog.text
    assert Replica.objects.filter(model_name="tiny", node__name="good-a").exists()


def test_node_token_enrols_an_address_keeps_it_when_not_given_and_refuses_one_that_is_not_an_address():
    from io import StringIO

    from django.core.management import call_command
    from django.core.management.base import CommandError

    call_command("node_token", "gpu-01", "--address", "10.0.0.21", stdout=StringIO())
    call_command("node_token", "gpu-01", stdout=StringIO())  # a new token, the address as it was
    assert Node.objects.get(name="gpu-01").address == "10.0.0.21"
    call_command("node_token", "gpu-01", "--address", "gpu-01.fleet.example", stdout=StringIO())
    assert Node.objects.get(name="gpu-01").address == "gpu-01.fleet.example"
    with pytest.raises(CommandError, match="--address: 'http://x/' is neither an IP address nor a host name"):
        call_command("node_token", "gpu-01", "--address", "http://x/", stdout=StringIO())
    assert Node.objects.get(name="gpu-01").address == "gpu-01.fleet.example"
