"""Each principal its own Redis user (issue 33): what a node, a gateway and the byte listener can
reach on a real Redis run with the file `manage.py redis_acl` prints, and the whole fleet's
work done under those users with no command refused.

Before, every process shared one password: any node could read every other's orders in the
shared `unacked` hash, overwrite or delete their progress and engine stats, pop the control
queue, MONITOR the broker or FLUSHALL it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import redis

from contracts import credentials, keys, signing
from contracts.progress import cancel_key
from contracts.tasks import COLLECT_PENDING_KEY
from fleet import redis_acl
from fleet.enrolment import issue_token

from .support.acl_redis import AclRedis
from .support.processes import process_env

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def acl_redis(tmp_path):
    server = AclRedis(tmp_path)
    yield server
    server.stop()


def enrol(acl_redis, name: str) -> redis.Redis:
    """Enrol `name` and load the ACL file again; the node's own client, as its agent makes it."""
    token = issue_token(name)
    acl_redis.reload()
    return acl_redis.client(acl_redis.node_url(name, signing.token_hash(token)))


def refused(call, *args) -> bool:
    try:
        call(*args)
    except redis.exceptions.NoPermissionError:
        return True
    except redis.ResponseError as error:
        return "NOPERM" in str(error) or "no permissions" in str(error)
    return False


def test_a_nodes_user_reaches_its_own_keys_and_queue_and_pushes_onto_control(acl_redis):
    n1 = enrol(acl_redis, "n1")
    n1.hset(keys.progress_key("n1"), "http://m/x/v1/", "{}")
    n1.zadd(keys.progress_sources_key("n1"), {"http://m/x/v1/": 1.0})
    n1.hset(keys.engine_stats_key("n1"), "7", "{}")
    assert n1.exists(cancel_key("n1", "http://m/x/v1/")) == 0
    n1.lpush("node.n1", "order")
    assert n1.rpop("node.n1") == b"order"
    n1.sadd("_kombu.binding.node.n1", "x")
    n1.hset(keys.unacked_keys("n1")["unacked_key"], "tag", "x")
    n1.lpush("control", "a task")
    n1.smembers("_kombu.binding.control")
    assert n1.set(COLLECT_PENDING_KEY, "1", nx=True, ex=5)


def test_a_nodes_user_cannot_touch_another_nodes_keys_queue_or_orders(acl_redis):
    n2 = enrol(acl_redis, "n2")
    n2.hset(keys.progress_key("n2"), "http://m/x/v1/", '{"state": "fetching"}')
    n2.hset(keys.engine_stats_key("n2"), "9", "{}")
    n1 = enrol(acl_redis, "n1")
    for call, args in [
        (n1.hget, (keys.progress_key("n2"), "http://m/x/v1/")),
        (n1.hset, (keys.progress_key("n2"), "http://m/x/v1/", '{"state": "failed"}')),
        (n1.hdel, (keys.progress_key("n2"), "http://m/x/v1/")),
        (n1.hdel, (keys.engine_stats_key("n2"), "9")),
        (n1.hgetall, (keys.engine_stats_key("n2"),)),
        (n1.set, (keys.node_prefix("n2") + "heartbeat", "{}")),
        (n1.getdel, (keys.node_prefix("n2") + "heartbeat",)),
        (n1.delete, (cancel_key("n2", "http://m/x/v1/"),)),
        (n1.lpush, ("node.n2", "order")),
        (n1.rpop, ("node.n2",)),
        (n1.lrange, ("node.n2", 0, -1)),
        (n1.hgetall, (keys.unacked_keys("n2")["unacked_key"],)),
        (n1.hgetall, ("unacked",)),  # kombu's shared default, where every node's orders were
        (n1.rpop, ("control",)),
        (n1.lrange, ("control", 0, -1)),
        (n1.delete, ("control",)),
        (n1.sadd, ("_kombu.binding.control", "x")),
        (n1.hset, ("llmgw:limit:{k}:minute", "x", 1)),
        (n1.set, ("llmgw:demand:wake:m", "1")),
        (n1.hset, ("llmgw:demand:load", "gw1", "{}")),
        # The tracker's peer records: a node announces through the byte listener, never writes them.
        (n1.hset, ("llmgw:swarm:" + "a" * 64, "n2", '{"host": "203.0.113.9"}')),
        (n1.hset, ("llmgw:swarm-fleet", "n2", "{}")),
        (n1.get, (COLLECT_PENDING_KEY,)),
        (n1.keys, ("*",)),
        (n1.scan, ()),
        (n1.randomkey, ()),
        (n1.config_get, ("*",)),
        (n1.flushall, ()),
        (n1.flushdb, ()),
        (n1.publish, ("/0.celery.pidbox", "shutdown")),
        (n1.execute_command, ("SUBSCRIBE", "/0.celery.pidbox")),
        (n1.execute_command, ("ACL", "LIST")),
        (n1.execute_command, ("ACL", "SETUSER", "node-n1", "~*")),
        (n1.execute_command, ("SHUTDOWN",)),
        (n1.execute_command, ("CLIENT", "LIST")),
        (n1.execute_command, ("SCRIPT", "FLUSH")),
        (n1.eval, ("return redis.call('HGETALL', KEYS[1])", 1, keys.progress_key("n2"))),
    ]:
        assert refused(call, *args), f"{call.__name__}{args} was allowed to node n1"
    assert refused(n1.execute_command, "MONITOR")
    # What n2 wrote is as it wrote it.
    probe = acl_redis.probe
    assert probe.hget(keys.progress_key("n2"), "http://m/x/v1/") == b'{"state": "fetching"}'
    assert probe.hexists(keys.engine_stats_key("n2"), "9")


def test_no_user_a_wrong_password_or_a_revoked_node_gets_in(acl_redis):
    enrol(acl_redis, "n1")
    anonymous = acl_redis.client(acl_redis.url)
    with pytest.raises(redis.exceptions.AuthenticationError):
        anonymous.get("x")
    wrong = acl_redis.client(credentials.redis_url_as(acl_redis.url, "node-n1", "guessed"))
    with pytest.raises(redis.exceptions.AuthenticationError):
        wrong.ping()
    # A new token: the old one's password opens nothing.
    old = acl_redis.node_url("n1", signing.token_hash(issue_token("n1")))
    issue_token("n1")
    acl_redis.reload()
    with pytest.raises(redis.exceptions.AuthenticationError):
        acl_redis.client(old).ping()


def test_a_gateway_and_the_byte_listener_reach_only_their_own_keys(acl_redis):
    enrol(acl_redis, "n1").hset(keys.progress_key("n1"), "http://m/x/v1/", "{}")
    gateway = acl_redis.client(acl_redis.url_of(redis_acl.gateway_user("gw1")))
    gateway.incrby("llmgw:limit:{k}:minute", 3)
    gateway.hset("llmgw:demand:load", "gw1", "{}")
    gateway.hget(keys.progress_key("n1"), "http://m/x/v1/")
    gateway.lpush("control", "fleet.wake")
    for call, args in [
        (gateway.hset, (keys.progress_key("n1"), "http://m/x/v1/", "{}")),
        (gateway.delete, (keys.engine_stats_key("n1"),)),
        (gateway.rpop, ("control",)),
        (gateway.lpush, ("node.n1", "order")),
        (gateway.keys, ("*",)),
        (gateway.flushall, ()),
        (gateway.publish, ("/0.celery.pidbox", "x")),
    ]:
        assert refused(call, *args), f"{call.__name__}{args} was allowed to the gateway"
    byte_listener = acl_redis.client(acl_redis.url_of(redis_acl.BYTES_USER))
    byte_listener.hset("llmgw:swarm:" + "a" * 64, "n1", "{}")
    for call, args in [(byte_listener.lpush, ("control", "x")), (byte_listener.get, ("llmgw:limit:{k}:minute",))]:
        assert refused(call, *args), f"{call.__name__}{args} was allowed to the byte listener"


def test_the_control_planes_user_makes_a_nodes_user_at_enrolment_and_removes_it_at_revocation(acl_redis, tmp_path):
    env = process_env(REDIS_URL=acl_redis.url_of(redis_acl.CONTROL_USER), LLMGW_REDIS_ACL="true")
    made = subprocess.run(
        [sys.executable, "manage.py", "node_token", "n7"], env=env, capture_output=True, text=True, timeout=60
    )
    assert made.returncode == 0, made.stderr
    token = made.stdout.strip()
    assert made.stderr == ""
    n7 = acl_redis.client(acl_redis.node_url("n7", signing.token_hash(token)))
    n7.hset(keys.progress_key("n7"), "s", "{}")
    # Saved to the ACL file, so a restarted Redis still knows it.
    assert "user node-n7 on " in acl_redis.aclfile.read_text()
    assert refused(n7.hget, keys.progress_key("n8"), "s")

    revoked = subprocess.run(
        [sys.executable, "manage.py", "node_token", "n7", "--revoke"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert revoked.returncode == 0, revoked.stderr
    with pytest.raises((redis.exceptions.AuthenticationError, redis.ConnectionError)):
        acl_redis.client(acl_redis.node_url("n7", signing.token_hash(token))).ping()


def test_manage_py_redis_acl_prints_a_file_redis_loads_and_a_url_per_principal(acl_redis):
    issue_token("gpu-07")
    env = process_env(REDIS_URL=acl_redis.url)
    printed = subprocess.run(
        [sys.executable, "manage.py", "redis_acl", "--gateway", "gw1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout.startswith("user default off") and "user node-gpu-07 on #" in printed.stdout
    assert "llmgw-redis-" not in printed.stdout  # only the passwords' hashes
    acl_redis.aclfile.write_text(printed.stdout + acl_redis.aclfile.read_text().splitlines()[-1] + "\n")
    acl_redis.probe.execute_command("ACL", "LOAD")
    url = subprocess.run(
        [sys.executable, "manage.py", "redis_acl", "--url", "gateway-gw1"], env=env, capture_output=True, text=True
    ).stdout.strip()
    assert acl_redis.client(url).ping()
    wrong = subprocess.run(
        [sys.executable, "manage.py", "redis_acl", "--url", "node-gpu-07"], env=env, capture_output=True, text=True
    )
    assert wrong.returncode != 0 and "a node makes its own from its token" in wrong.stderr
    assert "Traceback" not in wrong.stderr


@pytest.fixture
def as_control(acl_redis, settings):
    """This test process as the control plane on the ACL'd Redis: its clients and its Celery app as llmgw-control."""
    from celery import current_app

    url = acl_redis.url_of(redis_acl.CONTROL_USER)
    settings.REDIS_URL = url
    app = current_app
    saved = app.conf.broker_url
    app.conf.CELERY_BROKER_URL, app._pool, app.amqp._producer_pool = url, None, None
    yield url
    app.conf.CELERY_BROKER_URL, app._pool, app.amqp._producer_pool = saved, None, None


@pytest.mark.engine
def test_the_fleet_does_its_whole_job_under_its_own_users_and_redis_refuses_nothing(
    acl_redis, as_control, mirror_root, tmp_path
):
    """A heartbeat, a fetch with its progress and its report, a replica started and reported ready,
    the engine's load posted: the control worker as llmgw-control, the byte listener as llmgw-bytes,
    the agent as node-n1 (its user made from its token), and ACL LOG empty at the end."""
    from agent import engine_state, engines
    from contracts import progress
    from fleet import reconcile
    from fleet.models import Fetch, Node, Replica
    from launcher.demo_model import write_tiny_llama

    from .support.mirror import put
    from .support.processes import start_agent, start_byte_listener, start_celery_worker
    from .support.serving import wait_enrolled
    from .support.waiting import wait_until

    token = issue_token("n1")
    acl_redis.reload()
    write_tiny_llama(tmp_path / "gguf")
    put(mirror_root, "tiny", "v1", {p.name: p.read_bytes() for p in (tmp_path / "gguf").glob("*.gguf")})
    control = start_celery_worker("control", "control", tmp_path, REDIS_URL=as_control, LLMGW_MIRROR_ROOT=mirror_root)
    byte_listener, bytes_url = start_byte_listener(
        mirror_root, tmp_path, LLMGW_BYTES_REDIS_URL=acl_redis.url_of(redis_acl.BYTES_USER)
    )
    cache = tmp_path / "cache-n1"
    # The node is given the broker's address and its token, nothing more: it makes its user and password.
    agent = start_agent(
        "n1", token, cache, tmp_path, REDIS_URL=acl_redis.url, LLMGW_REDIS_ACL="true", LLMGW_BYTES_URL=bytes_url
    )
    try:
        assert "llmgw-redis-" not in agent.output()  # its password is never printed
        wait_enrolled(agent, "n1")
        node = Node.objects.get(name="n1")
        source = bytes_url + "tiny/v1/"

        Fetch.objects.request(node, source)
        wait_until(
            lambda: Fetch.objects.filter(node=node, source=source, state="complete").exists(),
            timeout=90,
            what=lambda: f"the fetch to be reported complete\n{acl_redis.denials()}\n{agent.output()[-3000:]}",
        )
        assert progress.read_one(acl_redis.client(as_control), "n1", source)["state"] == "complete"

        replica = Replica.objects.create(
            model_name="tiny",
            profile_name="cpu",
            node=node,
            source=source,
            engine="llamacpp",
            args=["--ctx-size", "256"],
        )
        reconcile.send_start(replica)
        wait_until(
            lambda: Replica.objects.get(pk=replica.pk).state == "ready",
            timeout=180,
            interval=0.5,
            what=lambda: f"the replica to be reported ready\n{acl_redis.denials()}\n{agent.output()[-3000:]}",
        )
        wait_until(
            lambda: acl_redis.probe.hexists(keys.engine_stats_key("n1"), str(replica.pk)),
            timeout=30,
            what="the engine's load to be posted under the node's prefix",
        )
        assert acl_redis.denials() == []
        # The node keeps what it took in its own hash; kombu's shared one is the control worker's alone.
        shared = [json.loads(v)[2] for v in acl_redis.probe.hvals("unacked")]
        assert set(shared) <= {"control"}, shared
        assert agent.alive() and control.alive() and byte_listener.alive()
    finally:
        agent.stop()
        control.stop()
        byte_listener.stop()
        for entry in engine_state.read_state(cache)["replicas"].values():
            if entry.get("pid") and engines.group_alive(entry["pid"]):
                engines.stop_group(entry["pid"], grace=3)


def test_a_gateway_holds_counts_limits_and_wakes_under_its_own_user_and_redis_refuses_nothing(acl_redis, tmp_path):
    """A request for a model at zero with a replica fetching on n1: the gateway counts the key's
    limits, writes its load, sends one wake onto the control queue and names n1's progress,
    all as gateway-gw1, with nothing in ACL LOG."""
    import base64

    import requests

    from catalog.models import Model
    from contracts import demand, progress
    from gateway.keys import create_key

    from .support.factories import add_model, add_replica
    from .support.gateway_process import start_gateway
    from .support.waiting import wait_until

    model = add_model("chat")
    Model.objects.filter(pk=model.pk).update(scaling_min=0, scaling_max=1)
    source = "http://127.0.0.1:1/chat/v1/"
    replica = add_replica("chat", "", state="fetching", source=source)
    n1 = enrol(acl_redis, "n1")
    snapshot = {"state": "fetching", "bytes_done": 43, "bytes_total": 100, "node": "n1", "source": source}
    n1.hset(progress.progress_key("n1"), source, json.dumps(snapshot))
    _, secret = create_key("k", limits={"requests_per_minute": 100, "tokens_per_day": 10_000})
    process, url = start_gateway(tmp_path, REDIS_URL=acl_redis.url_of(redis_acl.gateway_user("gw1")), LLMGW_HOLD_S=2)
    try:
        answer = requests.post(
            url + "/v1/chat/completions",
            json={"model": "chat", "messages": [{"role": "user", "content": "hi"}]},
            headers={"Authorization": f"Bearer {secret}"},
            timeout=60,
        )
        assert answer.status_code == 503, answer.text
        assert f"replica {replica.pk} on n1 is fetching 43%" in answer.text
        wakes = [json.loads(m) for m in acl_redis.probe.lrange("control", 0, -1)]
        assert [json.loads(base64.b64decode(m["body"]))[0] for m in wakes if m["headers"]["task"] == demand.WAKE] == [
            ["chat"]
        ]
        wait_until(lambda: acl_redis.probe.hlen(demand.LOAD_KEY), what="the gateway's load in Redis")
        assert acl_redis.probe.keys("llmgw:limit:*"), "the key's limits were not counted in Redis"
        assert acl_redis.denials() == []
    finally:
        process.stop()
