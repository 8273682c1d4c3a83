"""The serve page in a real browser: from a mirrored version to a catalog entry."""

import os
import time

import pytest

from catalog.models import Model
from fleet.models import Node
from mirror import scan

from .staff_browser import screenshot
from .support.mirror import put

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


SHARD = 1_600_000_000  # three of these are 4.8 GB: 4.47 GiB × 1.5 + 2 asks for 8 GB


@pytest.fixture
def three_part_gguf(mirror_root, settings):
    settings.BYTES_URL = "http://127.0.0.1:8001/"
    directory = put(mirror_root, "qwen2.5-7b", "q4_k_m", {})
    for i in (1, 2, 3):
        # Sparse: the size is what the plan reads, and nothing here hashes it.
        with open(directory / f"qwen2.5-7b-q4_k_m-0000{i}-of-00003.gguf", "wb") as f:
            os.truncate(f.fileno(), SHARD)
        # Copied in a while ago: a file still being written is not offered (issue 21).
        os.utime(directory / f"qwen2.5-7b-q4_k_m-0000{i}-of-00003.gguf", (time.time() - 60, time.time() - 60))
    put(mirror_root, "notes", "v1", {"readme.txt": b"not weights", "licence.txt": b"MIT"})
    scan.scan_mirror()


def open_serve_page(page, live_server, model: str, version: str):
    page.goto(live_server.url + "/admin/mirror/mirrorversion/")
    page.locator("#result_list").get_by_role("link", name=model, exact=True).click()
    screenshot(page, f"mirror-version-{model}")
    page.get_by_role("link", name="Serve").click()
    page.wait_for_url(f"{live_server.url}/serve/{model}/{version}/")


def test_a_three_file_gguf_is_offered_prefilled_and_lands_in_the_catalog(staff_page, live_server, three_part_gguf):
    page = staff_page
    Node.objects.create(name="small-box", memory_gb=7, engines=["llamacpp"])
    open_serve_page(page, live_server, "qwen2.5-7b", "q4_k_m")

    assert page.input_value("#id_name") == "qwen2.5-7b"
    assert page.input_value("#id_source") == "http://127.0.0.1:8001/qwen2.5-7b/q4_k_m/"
    assert page.input_value("#id_engine") == "llamacpp"
    assert page.input_value("#id_profile") == "cpu"
    assert page.input_value("#id_min_memory_gb") == "8"
    assert "3 files, served as the whole version" in page.inner_text("#file-count")
    # A warning shows above the form and does not block it.
    assert "The largest node has 7 GB and this needs about 8." in page.inner_text("#warning")
    assert page.is_visible("#serve-submit")
    screenshot(page, "serve-prefilled")

    page.fill("#id_context_length", "4096")
    page.fill("#id_replicas", "1")
    page.fill("#id_ctx_size", "8192")
    page.fill("#id_aliases", "qwen, default")
    page.click("#serve-submit")
    page.wait_for_url("**/admin/catalog/model/*/change/")
    assert "Added qwen2.5-7b to the catalog" in page.inner_text(".messagelist")

    page.goto(live_server.url + "/admin/catalog/model/")
    assert page.get_by_role("link", name="qwen2.5-7b").is_visible()
    screenshot(page, "serve-catalog-list")
    model = Model.objects.get(name="qwen2.5-7b")
    assert (model.added_by, model.declared, model.aliases) == ("ann", False, ["qwen", "default"])
    assert model.source.endswith("/q4_k_m/")
    profile = model.profiles.get()
    assert (profile.engine, profile.args, profile.min_memory_gb) == ("llamacpp", ["--ctx-size", "8192"], 8)


def test_a_version_of_text_files_shows_the_refusal_and_no_submit_button(staff_page, live_server, three_part_gguf):
    page = staff_page
    open_serve_page(page, live_server, "notes", "v1")
    assert page.inner_text("#refusal") == "This version cannot be served: nothing here reads .txt files."
    assert page.locator("#content").locator("input[type=submit], button[type=submit], form").count() == 0
    screenshot(page, "serve-refused")


def test_a_replica_count_of_two_in_words_shows_the_sentence_and_writes_nothing(
    staff_page, live_server, three_part_gguf
):
    page = staff_page
    open_serve_page(page, live_server, "qwen2.5-7b", "q4_k_m")
    page.fill("#id_context_length", "4096")
    page.fill("#id_replicas", "two")
    with page.expect_response(lambda r: r.request.method == "POST") as answer:
        page.click("#serve-submit")
    # htmx sent it, and only the form came back.
    assert answer.value.request.headers.get("hx-request") == "true"
    assert "<html" not in answer.value.text()
    error = page.locator("#error_replicas")
    error.wait_for()
    assert error.inner_text() == "the replica count must be a whole number"
    assert "Nothing was saved" in page.inner_text("#form-error")
    # What was typed stays, so it can be corrected rather than typed again.
    assert page.input_value("#id_replicas") == "two"
    assert page.input_value("#id_context_length") == "4096"
    screenshot(page, "serve-invalid-replicas")
    assert Model.objects.count() == 0
