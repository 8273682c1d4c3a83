"""Model kinds: an embedding model answers /v1/embeddings on a real llama.cpp engine started for it,
a chat model refuses it and the other way round, and a rerank model answers /v1/rerank."""

from __future__ import annotations

import gguf
import pytest
import redis
from django.conf import settings
from django.utils import timezone

from agent import engines
from catalog.models import Model
from contracts import credentials
from contracts.engine_args import kind_args
from fleet import reconcile
from fleet.models import Replica
from gateway.keys import create_key
from gateway.models import Usage
from launcher.demo_model import write_tiny_llama
from serving.planning import FileFacts, build_model, plan_serve
from serving.services import header_kind

from .fake_replica import FakeReplica
from .services import free_port
from .support.factories import add_model, add_replica
from .support.factories import add_node as node
from .support.fleet import sent
from .support.gateway import client, until_routed
from .support.sdk import openai
from .support.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def fake():
    replica = FakeReplica()
    yield replica
    replica.stop()


def kinded(name: str, kind: str) -> Model:
    model = add_model(name)
    Model.objects.filter(pk=model.pk).update(kind=kind)
    return model


# --- the gateway ------------------------------------------------------------------


def test_a_chat_model_refuses_embeddings_and_an_embedding_model_refuses_chat_each_naming_its_kind(gateway, fake):
    kinded("chat", "chat")
    kinded("embed", "embedding")
    add_replica("chat", fake.base)
    add_replica("embed", fake.base)
    _, secret = create_key("kinds")
    until_routed(client(secret), gateway.url, "embed")
    api = openai.OpenAI(base_url=gateway.url + "/v1", api_key=secret, max_retries=0)

    with pytest.raises(openai.BadRequestError) as raised:
        api.embeddings.create(model="chat", input="hello")
    assert raised.value.status_code == 400
    assert raised.value.body["message"] == (
        "chat is a chat model: it answers /v1/chat/completions and /v1/completions, not /v1/embeddings, "
        "which is for embedding models."
    )
    with pytest.raises(openai.BadRequestError) as raised:
        api.chat.completions.create(model="embed", messages=[{"role": "user", "content": "hi"}])
    assert raised.value.body["message"] == (
        "embed is a embedding model: it answers /v1/embeddings, not /v1/chat/completions, which is for chat models."
    )
    assert fake.paths == []  # neither went on to the replica

    models = {m["id"]: m for m in client(secret).get(gateway.url + "/v1/models").json()["data"]}
    assert (models["chat"]["kind"], models["embed"]["kind"]) == ("chat", "embedding")


def test_a_rerank_model_answers_v1_rerank_from_its_engines_rerank_endpoint_and_nothing_else(gateway, fake):
    kinded("ranker", "rerank")
    add_replica("ranker", fake.base)
    _, secret = create_key("rerank")
    session = client(secret)
    until_routed(session, gateway.url, "ranker")
    answer = session.post(
        gateway.url + "/v1/rerank", json={"model": "ranker", "query": "q", "documents": ["a", "b"]}, timeout=10
    )
    assert answer.status_code == 200, answer.text
    assert fake.paths == ["/v1/rerank"]
    refused = session.post(gateway.url + "/v1/embeddings", json={"model": "ranker", "input": "x"}, timeout=10)
    assert refused.status_code == 400
    assert refused.json()["error"]["message"].startswith("ranker is a rerank model: it answers /v1/rerank,")
    chat = kinded("chatty", "chat")
    add_replica(chat.name, fake.base)
    until_routed(session, gateway.url, "chatty")
    wrong = session.post(gateway.url + "/v1/rerank", json={"model": "chatty", "query": "q", "documents": []})
    assert wrong.status_code == 400 and "for rerank models" in wrong.json()["error"]["message"]


# --- a real engine --------------------------------------------------------------------


@pytest.mark.engine
def test_an_embedding_model_on_a_real_llama_cpp_engine_answers_embeddings_with_vectors_and_its_usage_is_counted(
    gateway, tmp_path
):
    (weights,) = write_tiny_llama(tmp_path / "gguf", name="embed", files=1)
    port = free_port()
    # The arguments the control plane sends for an embedding model, run as the agent runs them.
    argv = engines.command("llamacpp", weights, port, kind_args("llamacpp", "embedding"), model="embed")
    process = engines.spawn(argv, tmp_path / "engine.log")
    try:
        assert engines.wait_until_answers(process, port, timeout=120), engines.last_lines(tmp_path / "engine.log")
        kinded("embed", "embedding")
        add_replica("embed", f"http://127.0.0.1:{port}/v1")
        _, secret = create_key("vectors")
        until_routed(client(secret), gateway.url, "embed")
        api = openai.OpenAI(base_url=gateway.url + "/v1", api_key=secret, max_retries=0)
        answer = api.embeddings.create(model="embed", input=["hello there", "general kenobi"])
        assert len(answer.data) == 2
        assert len(answer.data[0].embedding) > 1 and all(isinstance(x, float) for x in answer.data[0].embedding)
        assert answer.data[0].embedding != answer.data[1].embedding
        assert answer.usage.prompt_tokens > 0

        def counted():
            row = Usage.objects.filter(key__name="vectors", model_name="embed").first()
            return row if row is not None and row.requests == 1 else None

        usage = wait_until(counted, timeout=10, what="the embeddings' usage to be written")
        assert (usage.prompt_tokens, usage.completion_tokens) == (answer.usage.prompt_tokens, 0)
    finally:
        engines.stop_group(process.pid, grace=3)


# --- how the engine is started for its kind -------------------------------------------


def test_the_start_of_an_embedding_models_replica_carries_the_embedding_switch_inside_the_signed_arguments():
    broker = redis.Redis.from_url(settings.REDIS_URL)
    broker.flushdb()
    kinded("embed", "embedding")
    replica = Replica.objects.create(
        model_name="embed", profile_name="cpu", node=node("a"), source="http://x/embed/v1/", engine="llamacpp"
    )
    replica.args = ["--ctx-size", "512"]
    reconcile.send_start(replica)
    # sent() checks the proof the node would check: the switch is part of what is signed.
    ((task, args, kwargs),) = sent(broker, "node.a")
    # An embedding engine resumes no conversation: llama-server keeps no prompt in host memory.
    assert task == "agent.start_replica" and args[3] == ["--ctx-size", "512", "--embedding", "--cache-ram", "0"]
    assert kwargs == {"model": "embed", "nonce": credentials.replica_nonce(replica.created)}


def test_a_replica_of_mirrored_weights_is_started_with_its_prompt_cache_bounded_to_what_the_estimate_counts():
    from catalog.memory import MB, estimate
    from mirror.models import MirrorVersion

    broker = redis.Redis.from_url(settings.REDIS_URL)
    broker.flushdb()
    kinded("chatty", "chat")
    header = {"format": "gguf", "layers": 24, "kv_heads": 2, "head_dim": 64, "weights_bytes": 5 * MB}
    MirrorVersion.objects.create(model="chatty", version="v1", scanned_at=timezone.now(), headers=header)
    source = f"{settings.BYTES_URL}chatty/v1/"
    replica = Replica.objects.create(
        model_name="chatty", profile_name="cpu", node=node("a"), source=source, engine="llamacpp"
    )
    replica.args = ["--ctx-size", "4096"]
    reconcile.send_start(replica)
    ((task, args, kwargs),) = sent(broker, "node.a")
    # 24 layers × 2 KV heads × 64 × (key + value) × 2 bytes × 4,096 tokens: 48 MiB, as many tokens again as the pool.
    assert args[3] == ["--ctx-size", "4096", "--cache-ram", "48"]
    assert estimate(header, "llamacpp", replica.args).prompt_cache == 48 * MB
    # A profile's own bound is sent as it is, and not twice.
    replica.args = ["--ctx-size", "4096", "--cache-ram", "512"]
    reconcile.send_start(replica)
    ((task, args, kwargs),) = sent(broker, "node.a")
    assert args[3] == ["--ctx-size", "4096", "--cache-ram", "512"]


def test_each_engine_is_told_its_kind_in_its_own_spelling(tmp_path):
    weights = tmp_path / "m.gguf"
    weights.write_bytes(b"GGUF")
    native = engines.command(
        "llamacpp", weights, 1, kind_args("llamacpp", "rerank"), which=lambda n: "/bin/llama-server"
    )
    assert "--reranking" in native
    embedding = engines.command(
        "llamacpp", weights, 1, kind_args("llamacpp", "embedding"), which=lambda n: "/bin/llama-server"
    )
    assert "--embedding" in embedding
    # vLLM's pooling runner: no GPU here, so only the argument list is checked.
    vllm = engines.command("vllm", tmp_path, 1, kind_args("vllm", "embedding"), which=lambda n: "/bin/vllm")
    assert vllm[-2:] == ["--task", "embed"]
    assert kind_args("llamacpp", "chat") == [] and kind_args("llamacpp", "embedding", ["--embedding"]) == []
    assert (
        kind_args("llamacpp", "embedding", ["--embeddings"]) == []
        and kind_args("llamacpp", "rerank", ["--rerank"]) == []
    )


# --- the serve page -------------------------------------------------------------------


def write_header_only(path, arch: str, pooling: int | None) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    if pooling is not None:
        writer.add_pooling_type(gguf.PoolingType(pooling))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_the_serve_page_offers_the_kind_the_gguf_header_says_and_chat_otherwise(tmp_path):
    write_header_only(tmp_path / "bge.gguf", "bert", 1)
    write_header_only(tmp_path / "rank.gguf", "bert", 4)
    write_header_only(tmp_path / "chat.gguf", "llama", None)
    assert header_kind(tmp_path / "bge.gguf") == "embedding"
    assert header_kind(tmp_path / "rank.gguf") == "rerank"
    assert header_kind(tmp_path / "chat.gguf") == ""
    assert header_kind(tmp_path / "missing.gguf") == ""

    files = [FileFacts("bge.gguf", 100)]
    assert plan_serve("bge", "v1", files, "http://b/", None, None, header_kind="embedding").kind == "embedding"
    assert plan_serve("bge", "v1", files, "http://b/", None, None).kind == "chat"

    form = {"name": "bge", "source": "http://b/bge/v1/bge.gguf", "context_length": "512", "replicas": "1"}
    model, _ = build_model({**form, "engine": "llamacpp", "kind": "embedding"}, "http://b/")
    assert model.kind == "embedding"
    assert build_model({**form, "engine": "llamacpp"}, "http://b/")[0].kind == "chat"
    with pytest.raises(Exception, match="the kind must be one of chat, embedding, rerank, not vision"):
        build_model({**form, "engine": "llamacpp", "kind": "vision"}, "http://b/")


def test_post_api_serve_takes_the_kind(live_server, mirror_root, settings):
    from .staff_api import token_session

    settings.BYTES_URL = "http://127.0.0.1:8001/"
    served = token_session().post(
        live_server.url + "/api/serve/",
        json={
            "name": "bge",
            "source": "http://127.0.0.1:8001/bge/v1/bge.gguf",
            "engine": "llamacpp",
            "kind": "embedding",
            "context_length": 512,
            "replicas": 1,
        },
    )
    assert served.status_code == 201, served.text
    assert Model.objects.get(name="bge").kind == "embedding"


@pytest.mark.engine
def test_an_embedding_model_served_through_the_api_is_started_by_the_agent_with_the_switch_and_answers_vectors(
    settings,
    tmp_path,
    mirror_root,
    byte_listener,
    control_worker,
    agent_n1,  # noqa: F811  (the fixture imported above)
    live_server,
    gateway,
):
    from fleet.models import Node
    from mirror import scan

    from .staff_api import token_session
    from .support.mirror import put

    agent, _ = agent_n1
    settings.BYTES_URL = byte_listener
    (weights,) = write_tiny_llama(tmp_path / "gguf", name="embed", files=1)
    put(mirror_root, "embed", "v1", {weights.name: weights.read_bytes()})
    scan.scan_mirror()

    def enrolled():
        node = Node.objects.filter(name="n1").first()
        return node is not None and node.state == Node.State.READY and "llamacpp" in node.engines

    wait_until(
        enrolled,
        timeout=60,
        interval=0.5,
        what=f"n1's heartbeat\n{agent.output()[-3000:]}",
    )
    api = token_session()
    plan = api.get(live_server.url + "/api/serve/plan/?model=embed&version=v1").json()
    assert plan["kind"] == "chat"  # a llama-shaped header names no pooling: the page offers chat
    served = api.post(
        live_server.url + "/api/serve/",
        json={
            "name": "embed",
            "kind": "embedding",
            "source": plan["source"],
            "engine": "llamacpp",
            "profile": "cpu",
            "context_length": 256,
            "ctx_size": 256,
            "replicas": 1,
        },
    )
    assert served.status_code == 201, served.text
    replica = wait_until(
        lambda: Replica.objects.filter(model_name="embed", state="ready").first(),
        timeout=240,
        interval=0.5,
        what=f"a ready replica: {list(Replica.objects.values('state', 'reason'))}\n{agent.output()[-3000:]}",
    )
    _, secret = create_key("e2e-vectors")
    until_routed(client(secret), gateway.url, "embed")
    answer = openai.OpenAI(base_url=gateway.url + "/v1", api_key=secret, max_retries=0).embeddings.create(
        model="embed", input="hello"
    )
    assert len(answer.data) == 1 and len(answer.data[0].embedding) > 1
    assert answer.usage.prompt_tokens > 0
    row = wait_until(
        lambda: Usage.objects.filter(key__name="e2e-vectors", model_name="embed", requests=1).first(),
        timeout=10,
        what="the usage to be written",
    )
    assert row.prompt_tokens == answer.usage.prompt_tokens
    # The agent started the engine with the switch the control plane sent, in the signed arguments.
    from agent import engine_state

    _, cache = agent_n1
    started = engine_state.read_state(cache)["replicas"][str(replica.pk)]["args"]
    assert started[:5] == ["--ctx-size", "256", "--parallel", "4", "--embedding"]
    # No prompt cache (catalog.memory.prompt_cache_args): an embedding engine resumes no
    # conversation, and left to llama-server it would keep up to 8 GiB of prompts.
    assert started[5:] == ["--cache-ram", "0"]


def test_the_serve_plan_of_a_mirrored_gguf_with_a_pooling_type_offers_embedding(live_server, mirror_root, admin_client):
    from mirror import scan

    from .staff_api import token_session
    from .support.mirror import put

    write_header_only(mirror_root / "bge.gguf", "bert", 2)
    put(mirror_root, "bge", "v1", {"bge.gguf": (mirror_root / "bge.gguf").read_bytes()})
    (mirror_root / "bge.gguf").unlink()
    scan.scan_mirror()
    plan = token_session().get(live_server.url + "/api/serve/plan/?model=bge&version=v1").json()
    assert plan["kind"] == "embedding"
    page = admin_client.get("/serve/bge/v1/").content.decode()
    assert '<option value="embedding" selected>' in page
