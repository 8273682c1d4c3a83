"""The playground in a real browser, through a real gateway, on the real engine (SmolLM2 on llama.cpp).

A person asks the demo model a question (tests/real_model.py's: the README's own is not
answered alike on every CPU) and watches it stream with its
timings, compares two models on one prompt, reads the request as curl and as Python,
stops a long answer (and the engine's slot is free again), and sees the sentence of a
refusal when the page's key is over its limit.
"""

from __future__ import annotations

import pytest
import requests
from django.test import Client

from catalog.models import Model, Profile
from fleet.models import Node, Replica
from gateway.keys import create_key
from gateway.models import ApiKey

from .real_model import ANSWER, MODEL, QUESTION
from .staff_browser import chromium_page, log_in_as_staff
from .support.gateway import client, until_routed
from .support.waiting import wait_until

pytestmark = [pytest.mark.django_db(transaction=True)]

TWIN = MODEL + "-twin"


@pytest.fixture
def playground(engine, gateway, live_server, settings):
    """Two catalog models served by the engine, routed by the gateway; a staff person's browser on /playground/."""
    node = Node.objects.create(name="n1")
    for name in (MODEL, TWIN):
        model = Model.objects.create(name=name, source="http://127.0.0.1:1/smollm2/", context_length=2048)
        Profile.objects.create(model=model, name="cpu", engine="llamacpp")
        Replica.objects.create(model_name=name, profile_name="cpu", node=node, state="ready", endpoint=engine)
    _, secret = create_key("routing")
    for name in (MODEL, TWIN):
        until_routed(client(secret), gateway.url, name)
    settings.GATEWAY_URL = gateway.url + "/"
    with chromium_page() as page:
        log_in_as_staff(page, live_server)
        page.goto(live_server.url + "/playground/")
        yield page


def send(page, prompt: str, system: str = "", max_tokens: int = 48, temperature: float = 0) -> None:
    page.fill("#system", system)
    page.fill("#prompt", prompt)
    page.fill("#max_tokens", str(max_tokens))
    page.fill("#temperature", str(temperature))
    page.click("#send")


def finished(page, box: str) -> str:
    page.wait_for_selector(f"#answer-{box}[data-state=done], #answer-{box}[data-state=refused]", timeout=120_000)
    return page.get_attribute(f"#answer-{box}", "data-state")


def figure(page, box: str, name: str) -> str:
    return page.inner_text(f"#answer-{box} .{name}")


def engine_busy(endpoint: str) -> bool:
    slots = requests.get(endpoint.removesuffix("/v1") + "/slots", timeout=10).json()
    return any(slot["is_processing"] for slot in slots)


@pytest.mark.engine
@pytest.mark.browser
# One test for the whole visit: each new one would start another gateway and browser (about 9 s).
def test_an_answer_streams_with_its_timings_two_models_answer_side_by_side_stop_frees_the_slot_and_a_refusal_is_said(
    playground, engine
):
    page = playground
    key = ApiKey.objects.get(name="playground: ann")
    assert key.owner.username == "ann"
    assert "playground: ann" in page.inner_text("#playground-key")
    assert "llmgw-" not in page.content(), "the page key's secret reached the browser"
    assert all(not c["value"].startswith("llmgw-") for c in page.context.cookies())

    # Each chunk's arrival is counted by the page; the answer grows while it streams.
    page.evaluate(
        """() => { window.seen = []; new MutationObserver(() =>
             window.seen.push(document.querySelector('#answer-a .text').textContent.length)
           ).observe(document.querySelector('#answer-a .text'), {childList: true, characterData: true, subtree: true}); }"""
    )
    send(page, QUESTION)
    assert finished(page, "a") == "done", page.inner_text("#answer-a")
    assert ANSWER in page.inner_text("#answer-a .text")
    assert int(page.get_attribute("#answer-a", "data-chunks")) > 1
    lengths = [n for n in page.evaluate("window.seen") if n]
    assert len(set(lengths)) > 1, f"the answer arrived in one piece: {lengths}"
    assert int(figure(page, "a", "first-token")) > 0
    assert float(figure(page, "a", "tokens-per-second")) > 0
    completion = int(figure(page, "a", "completion-tokens"))
    assert int(figure(page, "a", "prompt-tokens")) > 0 and completion > 1
    assert figure(page, "a", "cached-tokens").isdigit()

    # The same prompt to two models, side by side.
    page.check("#compare")
    page.select_option("#model-a", MODEL)
    page.select_option("#model-b", TWIN)
    send(page, QUESTION)
    assert finished(page, "a") == "done" and finished(page, "b") == "done"
    assert page.inner_text("#answer-a .model") == MODEL and page.inner_text("#answer-b .model") == TWIN
    for box in "ab":
        assert ANSWER in page.inner_text(f"#answer-{box} .text")
        assert int(figure(page, box, "completion-tokens")) > 0

    # Show code: the same request as curl and with the openai client, without the secret.
    page.click("#show-code")
    page.wait_for_selector("#code-curl")
    curl, python = page.inner_text("#code-curl"), page.inner_text("#code-python")
    assert f"{playground_gateway(page)}v1/chat/completions" in curl and QUESTION in curl
    assert "from openai import OpenAI" in python and repr(MODEL) in python
    assert "llmgw-" not in curl + python

    # Stop hangs up: the relay closes its request, the gateway its engine's, and the slot is free again.
    page.uncheck("#compare")
    # An answer of most of the context's 2,048 tokens (the model counts on, greedy): many seconds of the
    # engine's slot, were the hang-up not passed on.
    send(page, "Count from 1 to 5000, one number a line.", max_tokens=1900)
    page.wait_for_function("Number(document.querySelector('#answer-a').dataset.chunks || 0) > 5")
    assert engine_busy(engine), "the long answer never took the engine's slot"
    page.click("#stop")
    page.wait_for_selector("#answer-a[data-state=stopped]")
    wait_until(lambda: not engine_busy(engine), timeout=5, what="the engine to free the slot of the stopped answer")

    # Over its limit, the page's key is refused by the gateway, and the page says the gateway's sentence.
    ApiKey.objects.filter(pk=key.pk).update(tokens_per_day=1)

    def refused() -> bool:
        send(page, QUESTION, max_tokens=4)
        return finished(page, "a") == "refused"

    wait_until(refused, timeout=20, what="the gateway to refuse the page's key over its daily tokens")
    sentence = page.inner_text("#answer-a .text")
    assert "token" in sentence.lower() and "Traceback" not in sentence, sentence


def playground_gateway(page) -> str:
    from django.conf import settings

    return settings.GATEWAY_URL


@pytest.mark.parametrize(
    ("form", "sentence"),
    [
        ({"model": "not-in-the-catalog", "prompt": "hi"}, "not-in-the-catalog is not a model this key may use."),
        ({"model": "allowed", "prompt": "  "}, "Write a message to send."),
        ({"model": "allowed", "prompt": "hi", "temperature": "hot"}, "Temperature is a number"),
        ({"model": "allowed", "prompt": "hi", "temperature": "9"}, "Temperature is between 0 and 2."),
        ({"model": "allowed", "prompt": "hi", "max_tokens": "0"}, "The output limit is between 1 and"),
    ],
)
def test_a_form_the_page_would_not_send_gets_a_sentence_and_nothing_reaches_the_gateway(admin_client, form, sentence):
    Model.objects.create(name="allowed", source="http://127.0.0.1:1/m/", context_length=2048)
    answer = admin_client.post("/playground/stream/", form)
    assert answer.status_code == 400 and answer.content.decode().startswith(sentence), answer.content


def test_a_person_not_signed_in_is_sent_to_sign_in_and_no_key_is_made():
    browser = Client()
    for path in ("/playground/", "/playground/stream/", "/playground/code/"):
        answer = browser.post(path) if path != "/playground/" else browser.get(path)
        assert answer.status_code == 302 and "/me/login/" in answer["Location"], path
    assert not ApiKey.objects.filter(name__startswith="playground:").exists()
