"""Engines answer only the gateway: each replica's engine is started with a secret the gateway presents.

A node's engine listens where the gateway can reach it, so anyone who can reach the
node could call it: no key, no usage counted, no limit. Here a real agent starts a
real llama.cpp engine (PyPI's server, through the shim) on a tiny GGUF the test
writes, and a request straight to its port is refused by the engine itself unless it
carries the replica's secret, which the gateway alone computes. vLLM needs a GPU: its
side is tested with the stand-in of test_engines, which enforces VLLM_API_KEY as vLLM does.
"""

from __future__ import annotations

import psutil
import pytest
import requests
from django.db import transaction

from agent import engine_state, engines, supervisor
from contracts import credentials, signing
from fleet import reconcile
from fleet.enrolment import issue_token, revoke_token
from fleet.models import Node, Replica
from gateway.keys import create_key
from launcher.demo_model import EOS_TOKEN_ID

from .support.engines import Reports, step_until
from .support.processes import engine_secret
from .support.serving import mirror_tiny, serve_tiny, wait_enrolled
from .support.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

ASK = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "logit_bias": {str(EOS_TOKEN_ID): -100}}


def secret_of(replica: Replica) -> str:
    return engine_secret(replica)["Authorization"].removeprefix("Bearer ")


def ready_replica(agent, exclude: int | None = None) -> Replica:
    def found():
        return Replica.objects.filter(model_name="tiny", state="ready").exclude(pk=exclude).first()

    return wait_until(
        found,
        timeout=240,
        interval=0.5,
        what=f"a ready replica: {list(Replica.objects.values('pk', 'state', 'reason'))}\n{agent.output()[-3000:]}",
    )


def command_lines() -> list[str]:
    lines = []
    for process in psutil.process_iter():
        try:
            lines.append("\0".join(process.cmdline()))
        except psutil.Error:
            pass  # ended meanwhile, or not ours to read
    return lines


@pytest.mark.engine
def test_a_real_agents_engine_refuses_anyone_but_the_gateway_and_a_replaced_replica_has_a_new_secret(
    settings,
    tmp_path,
    mirror_root,
    byte_listener,
    control_worker,
    agent_n1,  # noqa: F811
    live_server,
    gateway,
):
    agent, cache = agent_n1
    settings.BYTES_URL = byte_listener
    mirror_tiny(mirror_root, tmp_path)
    wait_enrolled(agent, "n1")
    serve_tiny(live_server)
    replica = ready_replica(agent)
    secret = secret_of(replica)
    assert secret

    # Straight to the engine's port: without the secret, and with a wrong one, the engine itself says 401.
    chat = replica.endpoint + "/chat/completions"
    bare = requests.post(chat, json=ASK, timeout=30)
    assert bare.status_code == 401, bare.text
    assert requests.get(replica.endpoint + "/models", timeout=30).status_code == 401
    for wrong in ("llmgw-replica-" + "0" * 64, secret[:-1], credentials.replica_secret("another node", replica.pk, "")):
        refused = requests.post(chat, json=ASK, headers=credentials.bearer(wrong), timeout=30)
        assert refused.status_code == 401, (wrong, refused.text)
    # With it, the engine answers (which is how the refusals above are the engine's and not a dead port's).
    assert requests.post(chat, json=ASK, headers=credentials.bearer(secret), timeout=60).status_code == 200

    # Through the gateway, a client with a key is answered: the gateway presents the secret.
    _, key = create_key("secret-test")
    client = requests.Session()
    client.headers["Authorization"] = f"Bearer {key}"
    wait_until(
        lambda: [m["ready"] for m in client.get(gateway.url + "/v1/models").json()["data"]] == [True],
        timeout=10,
        what="the gateway to route tiny",
    )
    answer = client.post(gateway.url + "/v1/chat/completions", json={"model": "tiny", **ASK}, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-llmgw-replica"] == str(replica.pk)

    # The secret is on no command line (`ps` shows every user's), in no log and not in the state file.
    assert not [line for line in command_lines() if secret in line]
    assert secret not in agent.output()
    assert secret not in (engine_state.state_dir(cache) / f"replica-{replica.pk}.log").read_text()
    assert secret not in (engine_state.state_dir(cache) / "state.json").read_text()
    assert secret not in gateway.process.output() and secret not in control_worker.output()
    # Nor is the node's token handed to the engine it runs.
    pid = engine_state.read_state(cache)["replicas"][str(replica.pk)]["pid"]
    assert "LLMGW_NODE_TOKEN" not in psutil.Process(pid).environ()

    # Replaced (stopped, and placed again): the new replica's engine has a secret of its own.
    with transaction.atomic():
        reconcile.stop(Replica.objects.get(pk=replica.pk), "replaced by the test")
    wait_until(
        lambda: not Replica.objects.filter(pk=replica.pk).exists(),
        timeout=60,
        what=f"the old replica to stop\n{agent.output()[-2000:]}",
    )
    reconcile.reconcile()
    new = ready_replica(agent, exclude=replica.pk)
    new_secret = secret_of(new)
    assert new_secret and new_secret != secret
    new_chat = new.endpoint + "/chat/completions"
    assert requests.post(new_chat, json=ASK, headers=credentials.bearer(secret), timeout=30).status_code == 401
    assert requests.post(new_chat, json=ASK, headers=credentials.bearer(new_secret), timeout=60).status_code == 200
    wait_until(
        lambda: client.post(
            gateway.url + "/v1/chat/completions", json={"model": "tiny", **ASK}, timeout=60
        ).headers.get("x-llmgw-replica")
        == str(new.pk),
        timeout=20,
        what="the gateway to answer from the new replica",
    )


# --- vLLM, by its stand-in -------------------------------------------------------------------


@pytest.mark.engine
def test_vllm_gets_its_secret_in_vllm_api_key_not_argv_and_the_supervisors_checks_present_it(
    tmp_path,
    vllm_stand_in,  # noqa: F811
    engine_cleanup,  # noqa: F811
):
    weights = tmp_path / "weights"
    weights.mkdir()
    cache = tmp_path / "cache"
    reports = Reports()
    sup = supervisor.Supervisor(cache, reports, token="llmgw-node-vllm-test")
    engine_state.want(cache, 3, "vllm", "http://mirror/m/v1/", weights, [], "m", nonce="1700000000000000")
    # Ready means the supervisor's own check was answered: the stand-in refuses it without the key.
    step_until(sup, lambda: "ready" in reports.states(3), 30, "the vLLM stand-in to answer the supervisor")
    entry = engine_state.read_state(cache)["replicas"]["3"]
    secret = credentials.replica_secret(signing.token_hash("llmgw-node-vllm-test"), 3, "1700000000000000")
    assert psutil.Process(entry["pid"]).environ()["VLLM_API_KEY"] == secret
    assert secret not in "\0".join(psutil.Process(entry["pid"]).cmdline())
    models = f"http://127.0.0.1:{entry['port']}/v1/models"
    assert requests.get(models, timeout=5).status_code == 401
    assert requests.get(models, headers=credentials.bearer(secret), timeout=5).status_code == 200


def test_an_engine_is_never_handed_the_nodes_token_nor_a_key_meant_for_another(monkeypatch):
    monkeypatch.setenv("LLMGW_NODE_TOKEN", "llmgw-node-secret")
    monkeypatch.setenv("API_KEY", "someone-elses")
    env = engines.engine_env("llamacpp", "s3")
    assert "LLMGW_NODE_TOKEN" not in env and "API_KEY" not in env
    assert env["LLAMA_API_KEY"] == "s3" and "VLLM_API_KEY" not in env
    assert engines.engine_env("vllm", "s3")["VLLM_API_KEY"] == "s3"
    monkeypatch.setenv("LLAMA_API_KEY", "left-over")
    assert "LLAMA_API_KEY" not in engines.engine_env("llamacpp", "")


def test_the_gateway_and_the_node_compute_the_same_secret_and_a_new_replica_of_a_reused_id_another():
    node = Node.objects.create(name="n9", token_hash=signing.token_hash("t"))
    first = Replica.objects.create(model_name="m", profile_name="p", node=node, state="ready", endpoint="http://x/v1")
    from gateway.routes import _replica_rows

    ((_, _, _, _, gateway_secret),) = _replica_rows(Replica.objects.filter(pk=first.pk))
    sup = supervisor.Supervisor("/nonexistent", Reports(), token="t")
    node_secret = sup.secret({"replica": first.pk, "nonce": credentials.replica_nonce(first.created)})
    assert gateway_secret == node_secret != ""
    # The same id again (SQLite reuses the highest after a delete): another creation time, another secret.
    first_pk = first.pk
    first.delete()
    again = Replica.objects.create(
        pk=first_pk, model_name="m", profile_name="p", node=node, state="ready", endpoint="http://x/v1"
    )
    ((_, _, _, _, again_secret),) = _replica_rows(Replica.objects.filter(pk=again.pk))
    assert again_secret != gateway_secret


def test_the_gateway_makes_a_replicas_secret_from_the_replica_key_alone_and_a_revoked_node_has_none():
    """The gateway never reads token_hash, which signs the node's orders: its secrets come from replica_key."""
    from gateway.routes import _replica_rows

    token = issue_token("n8")
    node = Node.objects.get(name="n8")
    assert node.replica_key == credentials.replica_key(signing.token_hash(token)) != ""
    assert node.replica_key != node.token_hash
    replica = Replica.objects.create(model_name="m", profile_name="p", node=node, state="ready", endpoint="http://x/v1")
    node_secret = supervisor.Supervisor("/nonexistent", Reports(), token=token).secret(
        {"replica": replica.pk, "nonce": credentials.replica_nonce(replica.created)}
    )
    # Made from the token hash as the old secret was, the gateway's would be another: it is not.
    old_style = "llmgw-replica-" + credentials._mac(node.token_hash, f"replica:{replica.pk}:")
    ((_, _, _, _, gateway_secret),) = _replica_rows(Replica.objects.filter(pk=replica.pk))
    assert gateway_secret == node_secret != old_style

    # Re-issued: a new replica key with the new token; revoked: none, so no secret to present.
    issue_token("n8")
    ((_, _, _, _, reissued_secret),) = _replica_rows(Replica.objects.filter(pk=replica.pk))
    assert reissued_secret not in ("", gateway_secret)
    assert revoke_token("n8")
    assert Node.objects.get(name="n8").replica_key == ""
    assert _replica_rows(Replica.objects.filter(pk=replica.pk))[0][4] == ""


def test_the_migration_gives_each_enrolled_node_the_replica_key_its_agent_derives():
    from django.db import connection
    from django.db.migrations.executor import MigrationExecutor

    token = issue_token("n7")
    Node.objects.create(name="never-enrolled")
    executor = MigrationExecutor(connection)
    graph = executor.loader.graph
    mine = next(key for key in graph.nodes if key[0] == "fleet" and key[1].endswith("_node_replica_key"))
    (before,) = [parent.key for parent in graph.node_map[mine].parents]
    executor.migrate([before])
    executor.loader.build_graph()
    executor.migrate([mine])
    executor.loader.build_graph()
    executor.migrate(executor.loader.graph.leaf_nodes())
    keys = dict(Node.objects.values_list("name", "replica_key"))
    assert keys == {"n7": credentials.replica_key(signing.token_hash(token)), "never-enrolled": ""}


# --- the gateway's side ------------------------------------------------------------------------


def test_the_gateway_presents_each_replicas_secret_and_an_engine_refusing_it_is_passed_over_not_blamed_on_the_client(
    gateway,
    replicas,  # noqa: F811
):
    from .support.factories import add_model
    from .support.gateway import client, until_routed

    node = Node.objects.create(name="locked", token_hash=signing.token_hash("llmgw-node-locked"))
    add_model("chat")
    refusing, answering = replicas("refusing"), replicas("answering")
    refusing.status = 401  # its engine knows another secret (its node re-enrolled and has not restarted it yet)
    made = [
        Replica.objects.create(model_name="chat", profile_name="cpu", node=node, state="ready", endpoint=r.base)
        for r in (refusing, answering)
    ]
    _, key = create_key("gw")
    session = client(key)
    until_routed(session, gateway.url)
    for _ in range(3):
        answer = session.post(gateway.url + "/v1/chat/completions", json={"model": "chat", "messages": []}, timeout=30)
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-llmgw-replica"] == str(made[1].pk)
    # Each engine was shown its own replica's secret, and nothing else.
    for fake, replica in zip((refusing, answering), made, strict=True):
        assert fake.headers, f"{fake.name} was never asked"
        assert {h["Authorization"] for h in fake.headers} == {engine_secret(replica)["Authorization"]}

    answering.status = 401
    both = session.post(gateway.url + "/v1/chat/completions", json={"model": "chat", "messages": []}, timeout=30)
    assert both.status_code == 502
    assert "refused the gateway's replica secret" in both.json()["error"]["message"]


@pytest.mark.engine
def test_an_engine_started_under_another_token_is_started_again_with_the_new_secret_when_adopted(
    tmp_path,
    vllm_stand_in,  # noqa: F811
    engine_cleanup,  # noqa: F811
):
    """A node re-enrolled: the gateway now presents secrets made with its new token."""
    weights = tmp_path / "weights"
    weights.mkdir()
    cache = tmp_path / "cache"
    reports = Reports()
    old = supervisor.Supervisor(cache, reports, token="llmgw-node-old")
    engine_state.want(cache, 4, "vllm", "http://mirror/m/v1/", weights, [], "m", nonce="1")
    step_until(old, lambda: "ready" in reports.states(4), 30, "the stand-in to answer")
    old_pid = engine_state.read_state(cache)["replicas"]["4"]["pid"]

    reports.clear()
    new = supervisor.Supervisor(cache, reports, token="llmgw-node-new")
    new.adopt()
    step_until(new, lambda: "ready" in reports.states(4), 30, "the engine to be started again")
    entry = engine_state.read_state(cache)["replicas"]["4"]
    assert entry["pid"] != old_pid and not engines.group_alive(old_pid)
    secret = credentials.replica_secret(signing.token_hash("llmgw-node-new"), 4, "1")
    assert psutil.Process(entry["pid"]).environ()["VLLM_API_KEY"] == secret

    # Adopted again under the same token: left running, not restarted.
    reports.clear()
    again = supervisor.Supervisor(cache, reports, token="llmgw-node-new")
    again.adopt()
    step_until(again, lambda: "ready" in reports.states(4), 30, "the adopted engine to be found ready")
    assert engine_state.read_state(cache)["replicas"]["4"]["pid"] == entry["pid"]
