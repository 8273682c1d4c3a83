"""The serve page with a large fleet and catalog: a bounded number of queries, and how long it takes."""

import statistics
import time

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from catalog.models import Model, Profile
from fleet.models import Node
from mirror import scan

from .staff_browser import ARTIFACTS
from .support.mirror import put

pytestmark = pytest.mark.django_db

NODES, MODELS = 1000, 500


@pytest.fixture
def big_world(mirror_root, settings):
    settings.BYTES_URL = "http://127.0.0.1:8001/"
    put(mirror_root, "qwen", "q4", {f"qwen-0000{i}-of-00003.gguf": b"x" * 1000 for i in (1, 2, 3)})
    scan.scan_mirror()
    Node.objects.bulk_create(
        Node(
            name=f"node-{i:04d}",
            engines=["llamacpp"] if i % 2 else ["vllm"],
            gpus=[{"name": "L4", "memory_mb": 24000}] if i % 10 == 0 else [],
            memory_gb=8 + i % 120,
            labels={"rack": str(i % 20)},
        )
        for i in range(NODES)
    )
    models = Model.objects.bulk_create(
        Model(
            name=f"model-{i:03d}",
            aliases=[f"alias-{i:03d}"],
            source=f"http://127.0.0.1:8001/model-{i:03d}/v1/",
            context_length=4096,
            declared=i % 5 == 0,
        )
        for i in range(MODELS)
    )
    Profile.objects.bulk_create(Profile(model=m, name="cpu", engine="llamacpp") for m in models)
    client = Client()
    client.force_login(get_user_model().objects.create_superuser("ann", "", "pw"))
    return client


def test_the_serve_page_makes_at_most_30_queries_with_1000_nodes_and_500_models(
    big_world, django_assert_max_num_queries
):
    with django_assert_max_num_queries(30):
        response = big_world.get("/serve/qwen/q4/")
    assert response.status_code == 200
    assert b"3 files, served as the whole version" in response.content


def test_the_plan_api_makes_at_most_30_queries_too(big_world, django_assert_max_num_queries):
    with django_assert_max_num_queries(30):
        response = big_world.get("/api/serve/plan/?model=qwen&version=q4")
    assert response.json()["files"] == 3


def test_benchmark_the_serve_page_render_time(big_world):
    """Measured, and kept in test-artifacts/; the bound is loose, to catch an order of magnitude."""
    big_world.get("/serve/qwen/q4/")  # warm: templates compiled, connections open
    timings = []
    for _ in range(10):
        start = time.perf_counter()
        response = big_world.get("/serve/qwen/q4/")
        timings.append(time.perf_counter() - start)
        assert response.status_code == 200
    median_ms = statistics.median(timings) * 1000
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "serve-page-benchmark.txt").write_text(
        f"serve page, {NODES} nodes and {MODELS} catalog models, 10 renders: "
        f"median {median_ms:.1f} ms, fastest {min(timings) * 1000:.1f} ms, slowest {max(timings) * 1000:.1f} ms\n"
    )
    print(f"\nserve page render: median {median_ms:.1f} ms over 10 renders")
    assert median_ms < 2000
