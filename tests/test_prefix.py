"""Prefix-aware routing with bounded load, on real replicas: llama-server on the demo model, real gateway processes.

Three engines run SmolLM2-135M-Instruct as the agent starts them (one thread, two slots
each, the prompt cache on); each test makes some of them the ready replicas of the model
and drives `manage.py gateway` processes with their access logs on. What is checked is
what a client and an operator see: the replica that answered (`x-llmgw-replica`), why it
was that one (the access log, the replica's page), and the cached tokens in the usage the
official clients read. The ring in gateway/prefix.py says which replica owns a key; the
tests ask it only to pick conversations that cover both replicas and to say where a key
should go, and check that the gateways did send it there.
"""

from __future__ import annotations

import json
import re
import threading

import pytest
import requests
from django.contrib.auth.models import User
from django.test import Client

from agent import engines
from catalog.models import Model, Profile
from fleet.models import Node, Replica
from gateway import prefix
from gateway.keys import create_key
from gateway.routes import Upstream

from . import real_model
from .real_model import MODEL
from .support.gateway import until_routed
from .support.gateway_process import start_gateway
from .support.processes import wait_until
from .support.sdk import anthropic, openai

pytestmark = [pytest.mark.engine, pytest.mark.django_db(transaction=True)]

# About 300 tokens each, different from the first word on, so that each conversation has a key of its own.
TOPICS = ["rivers", "castles", "violins", "glaciers", "bakeries", "lighthouses", "orchards", "comets"] * 4
METRICS_TOKEN = "prefix-metrics-token"


def system_prompt(n: int) -> str:
    topic = TOPICS[n % len(TOPICS)]
    return f"Conversation {n}. You are a guide to {topic}. " + " ".join(
        f"Rule {i}: when asked about {topic}, answer in one short sentence and stay polite." for i in range(18)
    )


def opening(n: int) -> list[dict]:
    return [{"role": "system", "content": system_prompt(n)}, {"role": "user", "content": f"Say hello, guide {n}."}]


@pytest.fixture(scope="module")
def engines_up(tmp_path_factory):
    started = []
    try:
        for n in range(3):
            process, endpoint, _ = real_model.start_engine(
                real_model.gguf(), tmp_path_factory.mktemp(f"engine{n}"), ["--threads", "1", "--parallel", "2"]
            )
            started.append((process, endpoint))
        yield [endpoint for _, endpoint in started]
    finally:
        for process, _ in started:
            engines.stop_group(process.pid, grace=5)


class Fleet:
    """The model, its ready replicas on some of the engines, a key, and gateway processes with access logs."""

    def __init__(self, endpoints: list[str], tmp_path, routing: str = "chat") -> None:
        self.endpoints = endpoints
        self.tmp_path = tmp_path
        model = Model.objects.create(
            name=MODEL, source="http://127.0.0.1:1/smollm2/", context_length=1024, routing_profile=routing
        )
        Profile.objects.create(model=model, name="cpu", engine="llamacpp", parallel=2)
        self.node = Node.objects.create(name="n1")
        self.replicas: list[Replica] = []
        _, self.key = create_key("prefix")
        self.gateways: list[tuple] = []

    def add_replica(self, engine: int) -> Replica:
        replica = Replica.objects.create(
            model_name=MODEL, profile_name="cpu", node=self.node, state="ready", endpoint=self.endpoints[engine]
        )
        self.replicas.append(replica)
        return replica

    def ring(self) -> prefix.Ring:
        # As the gateways build it from the table: the ready replicas in id order, weight 1.
        return prefix.Ring(tuple(Upstream(r.pk, r.endpoint, 1) for r in sorted(self.replicas, key=lambda r: r.pk)))

    def start_gateway(self, name: str) -> str:
        log = self.tmp_path / f"{name}-access.log"
        # One tenant: its clients are shown the cached tokens (docs/gateway.md), which the tests read.
        process, url = start_gateway(
            self.tmp_path,
            name=name,
            LLMGW_GATEWAY_ACCESS_LOG=log,
            LLMGW_METRICS_TOKEN=METRICS_TOKEN,
            LLMGW_GATEWAY_SHOW_CACHED_TOKENS="true",
        )
        self.gateways.append((process, url, log))
        session = requests.Session()
        session.headers["Authorization"] = f"Bearer {self.key}"
        until_routed(session, url, MODEL)
        return url

    def stop(self) -> None:
        for process, _, _ in self.gateways:
            process.stop()

    def access_lines(self) -> list[dict]:
        lines = []
        for _, _, log in self.gateways:
            if log.exists():
                lines += [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        return lines

    def routes(self, count: int) -> list[str]:
        """The access logs' `route` of the model's requests, once all `count` are written (just after each answer)."""
        return wait_until(
            lambda: len(lines := self.lines()) == count and [line["route"] for line in lines],
            timeout=10,
            what=lambda: f"{count} lines in the access logs: {self.lines()}",
        )

    def lines(self) -> list[dict]:
        return [line for line in self.access_lines() if line["model"] == MODEL]

    def chat(self, url: str, messages: list[dict], max_tokens: int = 4, **extra) -> requests.Response:
        body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, **real_model.GREEDY, **extra}
        response = requests.post(
            url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {self.key}"}, timeout=300
        )
        assert response.status_code == 200, response.text
        return response


@pytest.fixture
def replica_fleet(engines_up, tmp_path, redis_client):
    made = Fleet(engines_up, tmp_path)
    yield made
    made.stop()


def replica_of(response: requests.Response) -> int:
    return int(response.headers["x-llmgw-replica"])


def test_the_turns_of_one_conversation_land_on_one_replica_through_two_gateway_processes(replica_fleet):
    a, b = replica_fleet.add_replica(0), replica_fleet.add_replica(1)
    first, second = replica_fleet.start_gateway("gateway-1"), replica_fleet.start_gateway("gateway-2")
    ring = replica_fleet.ring()
    # Three conversations owned by each replica, so that one replica taking everything would fail.
    owned = {a.pk: [], b.pk: []}
    for n in range(len(TOPICS)):
        owner = ring.owner(prefix.key_of({"messages": opening(n)}))
        if len(owned[owner]) < 3:
            owned[owner].append(n)
    assert all(len(ns) == 3 for ns in owned.values()), owned

    for owner, conversations in owned.items():
        for n in conversations:
            messages = opening(n)
            answered_by, cached = [], []
            for turn in range(4):
                # Turns alternate between the two gateways, which share nothing but the table and Redis.
                response = replica_fleet.chat(first if turn % 2 == 0 else second, messages)
                answered_by.append(replica_of(response))
                answer = response.json()
                cached.append(answer["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0))
                messages = [
                    *messages,
                    {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
                    {"role": "user", "content": f"And turn {turn + 2}?"},
                ]
            assert answered_by == [owner] * 4, f"conversation {n}: {answered_by}, owner {owner}"
            # The replica had the conversation so far in its cache: every later turn skipped the system prompt.
            assert all(c > 200 for c in cached[1:]), f"conversation {n}: cached tokens {cached}"

    routes = replica_fleet.routes(24)
    assert set(routes) == {prefix.PREFIX}, routes


def test_a_replica_added_takes_only_its_share_of_the_conversations_and_the_rest_stay(replica_fleet):
    replica_fleet.add_replica(0), replica_fleet.add_replica(1)
    url = replica_fleet.start_gateway("gateway")
    conversations = range(24)
    before = {n: replica_of(replica_fleet.chat(url, opening(n), max_tokens=1)) for n in conversations}
    assert len(set(before.values())) == 2, before

    added = replica_fleet.add_replica(2)
    ring = replica_fleet.ring()
    goes_to_new = next(n for n in range(100) if ring.owner(prefix.key_of({"messages": opening(n)})) == added.pk)
    wait_until(
        lambda: replica_of(replica_fleet.chat(url, opening(goes_to_new), max_tokens=1)) == added.pk,
        timeout=15,
        what="the gateway to route to the replica added",
    )

    after = {n: replica_of(replica_fleet.chat(url, opening(n), max_tokens=1)) for n in conversations}
    moved = {n for n in conversations if after[n] != before[n]}
    assert all(after[n] == added.pk for n in moved), {n: (before[n], after[n]) for n in moved}
    # A third of the keys on average; none and all would both be wrong.
    assert 1 <= len(moved) <= 16, f"{len(moved)} of {len(conversations)} moved"
    assert after == {n: ring.owner(prefix.key_of({"messages": opening(n)})) for n in conversations}


def test_a_hot_prefix_spills_over_to_the_next_replica_at_the_bound_and_the_replicas_page_says_why(replica_fleet):
    a, b = replica_fleet.add_replica(0), replica_fleet.add_replica(1)
    url = replica_fleet.start_gateway("gateway")
    hot = opening(0)
    owner = replica_fleet.ring().owner(prefix.key_of({"messages": hot}))
    other = b.pk if owner == a.pk else a.pk
    results: list[int] = []
    failures: list[str] = []

    def one() -> None:
        try:
            # Long enough (ignore_eos: every one of its tokens) that all eight are in flight at once.
            results.append(replica_of(replica_fleet.chat(url, hot, max_tokens=96, ignore_eos=True)))
        except Exception as error:
            failures.append(str(error))

    clients = [threading.Thread(target=one) for _ in range(8)]
    for t in clients:
        t.start()
    for t in clients:
        t.join(timeout=300)
    assert not failures, failures
    # ceil(1.25 × 8 ÷ 2) = 5 at most on the owner; the rest went on to the next replica on the ring.
    assert results.count(owner) <= 5 and results.count(other) >= 3, results
    replica_fleet.routes(8)
    lines = replica_fleet.lines()
    assert {line["route"] for line in lines if line["replica"] == other} == {prefix.BOUNDED}, lines
    assert {line["route"] for line in lines if line["replica"] == owner} == {prefix.PREFIX}, lines
    # Once they are answered, the hot prefix's next request is its owner's again.
    assert replica_of(replica_fleet.chat(url, hot)) == owner

    staff = Client()
    staff.force_login(User.objects.create_superuser("staff", "staff@example.org", "x"))

    def page_says_bounded() -> str | None:
        page = staff.get(f"/admin/fleet/replica/{other}/change/").content.decode()
        return page if re.search(r"\d+ by prefix, bounded → next", page) else None

    page = wait_until(page_says_bounded, timeout=10, what="the replica's page to count the spilled requests")
    assert "<td class='route'>prefix, bounded → next</td>" in page


def test_a_model_routed_by_load_spreads_one_conversation_and_says_load(engines_up, tmp_path, redis_client):
    replica_fleet = Fleet(engines_up, tmp_path, routing="load")
    try:
        replica_fleet.add_replica(0), replica_fleet.add_replica(1)
        url = replica_fleet.start_gateway("gateway")
        seen = {replica_of(replica_fleet.chat(url, opening(3), max_tokens=1)) for _ in range(6)}
        # Least in flight takes turns between equally idle replicas: one conversation on both.
        assert len(seen) == 2, seen
        assert set(replica_fleet.routes(6)) == {prefix.LOAD}
    finally:
        replica_fleet.stop()


def test_cached_tokens_are_reported_in_usage_through_the_official_openai_and_anthropic_clients(replica_fleet):
    replica_fleet.add_replica(0)
    url = replica_fleet.start_gateway("gateway")
    gpt = openai.OpenAI(base_url=url + "/v1", api_key=replica_fleet.key, max_retries=0, timeout=120)
    claude = anthropic.Anthropic(base_url=url, api_key=replica_fleet.key, max_retries=0, timeout=120)
    # A system prompt no other test sent: the module's engines outlive each test, and their caches too.
    system, question = system_prompt(500), [{"role": "user", "content": "Say hello."}]
    messages = [{"role": "system", "content": system}, *question]

    completions = [
        gpt.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, **real_model.GREEDY) for _ in range(2)
    ]
    prompt = completions[0].usage.prompt_tokens
    cached = completions[1].usage.prompt_tokens_details.cached_tokens
    assert prompt > 200 and prompt - 8 <= cached < prompt, completions[1].usage

    message = claude.messages.create(
        model=MODEL, system=system, messages=question, max_tokens=4, extra_body=real_model.GREEDY
    )
    # Anthropic's shape: input_tokens are those not read from the cache, the rest cache_read_input_tokens.
    assert message.usage.cache_read_input_tokens >= prompt - 8, message.usage
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == prompt
    with claude.messages.stream(
        model=MODEL, system=system, messages=question, max_tokens=4, extra_body=real_model.GREEDY
    ) as stream:
        streamed = stream.get_final_message()
    assert streamed.usage.cache_read_input_tokens >= prompt - 8, streamed.usage
    assert streamed.usage.input_tokens + streamed.usage.cache_read_input_tokens == prompt

    response = gpt.responses.create(
        model=MODEL, instructions=system, input="Say hello.", max_output_tokens=16, extra_body=real_model.GREEDY
    )
    assert response.usage.input_tokens_details.cached_tokens >= prompt - 8, response.usage

    # The gateway's /metrics counts them per model.
    scrape = requests.get(url + "/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"}, timeout=10).text
    counted = re.search(rf'llmgw_gateway_cached_prompt_tokens_total{{model="{MODEL}"}} (\S+)', scrape)
    assert counted and float(counted.group(1)) >= 4 * (prompt - 8), scrape[-2000:]

    # The overview's hit rate: four of the five prompts came from the cache, near enough whole.
    staff = Client()
    staff.force_login(User.objects.create_superuser("staff", "staff@example.org", "x"))

    def hit_rate() -> int | None:
        page = staff.get("/admin/").content.decode()
        found = re.search(
            rf'<tr data-model="{MODEL}"><th>{MODEL}</th><td>[\d,]+</td><td>[\d,]+</td>'
            r'<td class="hit-rate">(\d+)%</td>',
            page,
        )
        return int(found.group(1)) if found and int(found.group(1)) > 0 else None

    rate = wait_until(hit_rate, timeout=10, what="the overview to show the prompt cache's hit rate")
    assert 70 <= rate <= 80, rate
