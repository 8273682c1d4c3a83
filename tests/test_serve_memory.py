"""The serve page's memory figure: the header estimate with its parts, following the context pool as it is typed."""

from __future__ import annotations

import re

import pytest

from catalog.memory import GB, MB, estimate, prompt_cache_args
from mirror import scan
from mirror.models import MirrorVersion

from .staff_browser import chromium_page, log_in_as_staff, screenshot
from .support.mirror import settle
from .weights import write_gqa_gguf

# Qwen2.5-0.5B's shape, as mirror.headers summarises a GGUF of it.
HEADER = {
    "format": "gguf",
    "layers": 24,
    "heads": 14,
    "kv_heads": 2,
    "head_dim": 64,
    "embedding": 896,
    "vocab": 151936,
    "trained_context": 32768,
    "weights_bytes": 525 * MB,
}


def test_the_kv_cache_is_layers_times_kv_heads_times_head_size_times_two_per_token_of_the_pool():
    at_2k = estimate(HEADER, "llamacpp", ["--ctx-size", "2048"])
    at_16k = estimate(HEADER, "llamacpp", ["--ctx-size", "16384"])
    assert at_2k.kv_cache == 24 * 2 * 64 * 2 * 2 * 2048 == 24 * MB
    assert at_16k.kv_cache == 8 * at_2k.kv_cache
    assert at_2k.weights == at_16k.weights == 525 * MB
    assert at_2k.overhead == at_16k.overhead
    assert at_2k.total == at_2k.weights + at_2k.kv_cache + at_2k.prompt_cache + at_2k.overhead


def test_the_prompt_cache_is_counted_at_the_bound_the_engine_is_started_with():
    # Left to llama-server it would keep up to 8,192 MiB of prompts whatever the model: the
    # control plane starts it bounded to one pool's KV cache again, and that is what is counted.
    default = estimate(HEADER, "llamacpp", ["--ctx-size", "2048"])
    assert default.prompt_cache == default.kv_cache == 24 * MB
    assert prompt_cache_args("llamacpp", HEADER, ["--ctx-size", "2048"]) == ["--cache-ram", "24"]
    # A profile's own bound wins, is counted, and gets no second flag.
    own = ["--ctx-size", "2048", "--cache-ram", "100"]
    assert estimate(HEADER, "llamacpp", own).prompt_cache == 100 * MB
    assert prompt_cache_args("llamacpp", HEADER, own) == []
    assert estimate(HEADER, "llamacpp", ["--ctx-size", "2048", "-cram=0"]).prompt_cache == 0
    unbounded = estimate(HEADER, "llamacpp", ["--ctx-size", "2048", "--cache-ram", "-1"])
    assert unbounded.prompt_cache == 0 and "no bound" in unbounded.missing
    # Where the header does not say how big the KV cache is, no prompt is kept in host memory.
    assert prompt_cache_args("llamacpp", None, []) == ["--cache-ram", "0"]
    assert prompt_cache_args("llamacpp", {"weights_bytes": 5 * MB}, []) == ["--cache-ram", "0"]
    assert prompt_cache_args("vllm", HEADER, []) == []
    # An embedding or rerank engine resumes no conversation: started with no prompt cache, none counted.
    for switch in ("--embedding", "--reranking"):
        assert prompt_cache_args("llamacpp", HEADER, ["--ctx-size", "2048", switch]) == ["--cache-ram", "0"]
        assert estimate(HEADER, "llamacpp", ["--ctx-size", "2048", switch]).prompt_cache == 0
    assert estimate({**HEADER, "format": "safetensors"}, "vllm", []).prompt_cache == 0


def test_a_quantized_cache_type_shrinks_the_kv_cache_and_slots_share_the_pool():
    f16 = estimate(HEADER, "llamacpp", ["--ctx-size", "8192"])
    q8 = estimate(HEADER, "llamacpp", ["--ctx-size", "8192", "--cache-type-k", "q8_0", "--cache-type-v", "q8_0"])
    assert q8.kv_cache == pytest.approx(f16.kv_cache * 34 / 64, rel=1e-6)
    four = estimate(HEADER, "llamacpp", ["--ctx-size", "8192"], parallel=4)
    assert four.kv_cache == f16.kv_cache
    assert four.overhead > f16.overhead


def test_vllm_takes_its_share_of_the_card_and_at_least_the_kv_for_its_longest_request():
    header = {**HEADER, "format": "safetensors"}
    alone = estimate(header, "vllm", ["--max-model-len", "32768"])
    assert alone.kv_cache == 24 * 2 * 64 * 2 * 2 * 32768
    on_card = estimate(header, "vllm", ["--gpu-memory-utilization", "0.5"], gpu_memory_bytes=24 * GB)
    assert on_card.weights + on_card.kv_cache == 12 * GB


def test_no_header_means_no_estimate():
    assert estimate({}, "llamacpp") is None
    assert estimate({"error": "x", "weights_bytes": 5}, "llamacpp") is None


@pytest.mark.django_db
def test_the_serve_page_prefills_the_header_estimate_and_says_so_and_the_size_rule_where_there_is_none(
    mirror_root, admin_client
):
    write_gqa_gguf(mirror_root / "gqa" / "q8" / "gqa.gguf")
    (mirror_root / "junk" / "v1").mkdir(parents=True)
    (mirror_root / "junk" / "v1" / "model.gguf").write_bytes(b"GGUF" + b"\0" * 300)
    settle(mirror_root)  # copied in a while ago, not still being written
    scan.scan_mirror()
    page = admin_client.get("/serve/gqa/q8/").content.decode()
    assert "is the header&#x27;s estimate" in page or "is the header's estimate" in page
    assert 'id="memory-kv"' in page
    headers = MirrorVersion.objects.get(model="gqa").headers
    expected = estimate(headers, "llamacpp", [])
    assert f'name="min_memory_gb" value="{expected.total_gb}"' in page
    plan = admin_client.get("/api/serve/plan/", {"model": "gqa", "version": "q8"}).json()
    assert plan["min_memory_gb"] == expected.total_gb
    assert plan["memory"]["source"] == "header"
    assert plan["memory"]["estimate"]["kv_cache_mb"] == round(expected.kv_cache / MB)
    junk = admin_client.get("/serve/junk/v1/").content.decode()
    assert "is the seed&#x27;s rule" in junk or "is the seed's rule" in junk
    assert "could not be read" in junk
    assert 'name="min_memory_gb" value="2"' in junk


@pytest.mark.django_db
def test_the_estimate_answers_for_a_pool_and_keeps_a_number_staff_wrote(mirror_root, admin_client):
    write_gqa_gguf(mirror_root / "gqa" / "q8" / "gqa.gguf", layers=64, kv_heads=8, width=512, heads=8)
    settle(mirror_root)
    scan.scan_mirror()
    url = "/serve/gqa/q8/estimate/"
    small = admin_client.get(
        url, {"engine": "llamacpp", "ctx_size": "1024", "min_memory_gb": "", "memory_estimated_gb": ""}
    )
    big = admin_client.get(
        url, {"engine": "llamacpp", "ctx_size": "262144", "min_memory_gb": "1", "memory_estimated_gb": "1"}
    )
    kv = [int(re.search(r'id="memory-kv">(\d+)<', r.content.decode()).group(1)) for r in (small, big)]
    assert kv[1] == kv[0] * 256
    assert 'f.value = "' in big.content.decode()
    kept = admin_client.get(
        url, {"engine": "llamacpp", "ctx_size": "262144", "min_memory_gb": "40", "memory_estimated_gb": "1"}
    )
    assert "f.value" not in kept.content.decode()


@pytest.mark.browser
@pytest.mark.django_db(transaction=True)
def test_the_estimate_follows_the_context_pool_as_it_is_typed(live_server, mirror_root):
    # 64 layers of 8 KV heads of 64: 128 KB of f16 cache a token, 16 GB at a pool of 131072.
    write_gqa_gguf(mirror_root / "wide" / "q8" / "wide.gguf", layers=64, kv_heads=8, width=512, heads=8)
    settle(mirror_root)
    scan.scan_mirror()
    with chromium_page() as page:
        log_in_as_staff(page, live_server)
        page.goto(live_server.url + "/serve/wide/q8/")
        first = int(page.locator("#id_min_memory_gb").input_value())
        assert page.locator("#memory-pool").inner_text() == "4096"
        page.fill("#id_ctx_size", "131072")
        page.wait_for_function("document.querySelector('#memory-pool').innerText === '131072'")
        kv_mb = int(page.locator("#memory-kv").inner_text())
        assert kv_mb == 64 * 8 * 64 * 2 * 2 * 131072 // MB
        page.wait_for_function(f"Number(document.querySelector('#id_min_memory_gb').value) > {first + 10}")
        screenshot(page, "serve-memory-estimate")
        # Staff's own number stays, whatever the pool does next.
        page.fill("#id_min_memory_gb", "99")
        page.fill("#id_ctx_size", "2048")
        page.wait_for_function("document.querySelector('#memory-pool').innerText === '2048'")
        assert page.locator("#id_min_memory_gb").input_value() == "99"
        # What is saved is what the field says.
        page.fill("#id_context_length", "2048")
        page.fill("#id_replicas", "1")
        page.click("#serve-submit")
        page.wait_for_url(re.compile(r".*/admin/catalog/model/\d+/change/"))
    from catalog.models import Profile

    assert Profile.objects.get(model__name="wide").min_memory_gb == 99
