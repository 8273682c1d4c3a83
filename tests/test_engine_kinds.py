"""Embeddings and rerank from real models of their kind, on this host's llama-server, through the gateway.

The models are BERT-shaped GGUFs the tests write with `gguf` (tests/bert_model.py): an
embedding model whose header says mean pooling, and a reranker with rank pooling and a
classifier head. Random weights, so the numbers mean nothing; the shapes are what a
client reads: one vector per input of the model's width, one score per document.
The serve page reads their kind from the header, and the engine is started for it with
the switches the control plane sends (`kind_args`), as a node starts it.
"""

from __future__ import annotations

import pytest
import requests

from agent import engines
from catalog.models import Model, Profile
from contracts.engines import kind_args
from fleet.models import Node, Replica
from gateway.keys import create_key
from gateway.models import Usage
from serving.services import header_kind

from . import bert_model
from .support.processes import wait_until
from .support.sdk import openai

pytestmark = [pytest.mark.engine, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def engine_for(tmp_path):
    started = []

    def start(kind: str):
        weights = bert_model.write_bert(tmp_path / f"{kind}.gguf", rerank=kind == "rerank")
        assert header_kind(weights) == kind  # what the serve page offers it as
        port = engines.free_port()
        args = ["--ctx-size", "512", *kind_args("llamacpp", kind)]
        argv = engines.command("llamacpp", weights, port, args, model=kind)
        log = tmp_path / f"{kind}.log"
        process = engines.spawn(argv, log)
        started.append(process)
        assert engines.wait_until_answers(process, port, timeout=120), engines.last_lines(log)
        return f"http://127.0.0.1:{port}/v1", argv

    yield start
    for process in started:
        engines.stop_group(process.pid, grace=3)


def routed(gateway, name: str, kind: str, endpoint: str) -> str:
    model = Model.objects.create(name=name, source=f"http://127.0.0.1:1/{name}/v1/", context_length=512, kind=kind)
    Profile.objects.create(model=model, name="cpu", engine="llamacpp")
    node, _ = Node.objects.get_or_create(name="n1")
    Replica.objects.create(model_name=name, profile_name="cpu", node=node, state="ready", endpoint=endpoint)
    _, key = create_key(f"{name}-key")
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {key}"
    wait_until(
        lambda: any(m["id"] == name and m["ready"] for m in session.get(gateway.url + "/v1/models").json()["data"]),
        timeout=10,
        what=f"{name} to be routed",
    )
    return key


def test_a_real_embedding_model_answers_embeddings_through_the_gateway_one_vector_of_its_width_per_input(
    gateway, engine_for
):
    endpoint, argv = engine_for("embedding")
    # Its header names its pooling: the agent adds no --pooling of its own.
    assert "--embedding" in argv and "--pooling" not in argv
    key = routed(gateway, "embedder", "embedding", endpoint)
    api = openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0)
    answer = api.embeddings.create(model="embedder", input=["hello there", "general kenobi", "hello there"])
    assert [len(d.embedding) for d in answer.data] == [bert_model.WIDTH] * 3
    assert answer.data[0].embedding != answer.data[1].embedding
    # The same text, the same vector: a model, not noise.
    assert answer.data[0].embedding == pytest.approx(answer.data[2].embedding)
    assert answer.usage.prompt_tokens > 0

    def counted():
        row = Usage.objects.filter(key__name="embedder-key", model_name="embedder").first()
        return row if row is not None and row.requests == 1 else None

    row = wait_until(counted, timeout=10, what="the embeddings' usage to be written")
    assert (row.prompt_tokens, row.completion_tokens) == (answer.usage.prompt_tokens, 0)


def test_a_real_reranker_scores_every_document_through_the_gateway(gateway, engine_for):
    endpoint, argv = engine_for("rerank")
    assert "--reranking" in argv
    key = routed(gateway, "ranker", "rerank", endpoint)
    documents = ["paris is in france", "the sea is blue", "cpus add numbers"]
    answer = requests.post(
        gateway.url + "/v1/rerank",
        json={"model": "ranker", "query": "where is paris", "documents": documents},
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    results = answer.json()["results"]
    assert sorted(r["index"] for r in results) == [0, 1, 2]
    assert all(isinstance(r["relevance_score"], float) for r in results)
    # Each document scored on its own: three scores, not one repeated.
    assert len({round(r["relevance_score"], 6) for r in results}) == 3
