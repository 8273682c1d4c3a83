"""The gateway's metrics, X-Request-Id and access log, read back from a real gateway's /metrics."""

from __future__ import annotations

import json
import time
import uuid
from types import SimpleNamespace

import pytest
import requests

from catalog.models import Model
from gateway.keys import create_key
from gateway.metrics import HOUR_PREFIX

from .scrape import samples, total, value
from .services import free_port
from .support.factories import add_model, add_replica
from .support.gateway import chat, client, held_stream, until_routed
from .support.gateway_process import start_gateway
from .support.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

TOKEN = "a-scrapers-token-of-some-length"


@pytest.fixture
def observed(transactional_db, tmp_path):
    """A gateway with /metrics behind TOKEN, key labels on, and its access log in a file."""
    log = tmp_path / "access.jsonl"
    process, url = start_gateway(
        tmp_path, LLMGW_METRICS_TOKEN=TOKEN, LLMGW_METRICS_KEY_LABELS="true", LLMGW_GATEWAY_ACCESS_LOG=log
    )
    yield SimpleNamespace(url=url, process=process, log=log)
    process.stop()


def scrape(url: str) -> dict:
    answer = requests.get(url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"].startswith("text/plain; version=0.0.4")
    return samples(answer.text)


def access_lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_metrics_are_closed_to_anonymous_and_wrong_tokens(observed):
    assert requests.get(observed.url + "/metrics").status_code == 401
    assert requests.get(observed.url + "/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert requests.get(observed.url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200


def test_requests_are_counted_by_model_kind_stream_and_status_with_their_tokens(observed, replicas):
    add_model()
    add_model("emb")
    Model.objects.filter(name="emb").update(kind="embedding")
    replica = replicas()
    add_replica("chat", replica.base)
    add_replica("emb", replica.base)
    _, secret = create_key("team-a")
    session = client(secret)
    until_routed(session, observed.url)
    before = scrape(observed.url)

    assert chat(session, observed.url).status_code == 200
    assert chat(session, observed.url).status_code == 200
    streamed = chat(session, observed.url, stream=True)
    assert streamed.status_code == 200 and "[DONE]" in streamed.text
    assert session.post(observed.url + "/v1/completions", json={"model": "chat", "prompt": "x"}).status_code == 200
    assert session.post(observed.url + "/v1/embeddings", json={"model": "emb", "input": "x"}).status_code == 200
    assert chat(session, observed.url, model="no-such-model").status_code == 404

    found = scrape(observed.url)

    def grew(name, **labels):
        return total(found, name, **labels) - total(before, name, **labels)

    assert grew("llmgw_gateway_requests_total", model="chat", kind="chat", stream="false", status="200") == 2
    assert grew("llmgw_gateway_requests_total", model="chat", kind="chat", stream="true", status="200") == 1
    assert grew("llmgw_gateway_requests_total", model="chat", kind="completion", status="200") == 1
    assert grew("llmgw_gateway_requests_total", model="emb", kind="embedding", status="200") == 1
    # A name the client made up is never a label: it is counted under "".
    assert grew("llmgw_gateway_requests_total", model="", kind="chat", status="404") == 1
    assert not any("no-such-model" in str(labels) for _, labels in found)
    # The fake replica counts 11 prompt and 3 completion tokens an answer.
    assert grew("llmgw_gateway_prompt_tokens_total", model="chat") == 4 * 11
    assert grew("llmgw_gateway_completion_tokens_total", model="chat") == 4 * 3
    assert grew("llmgw_gateway_prompt_tokens_total", model="emb") == 11
    assert grew("llmgw_gateway_request_duration_seconds_count", model="chat") == 4
    assert grew("llmgw_gateway_request_duration_seconds_count", model="emb") == 1
    assert grew("llmgw_gateway_time_to_first_token_seconds_count", model="chat") == 1
    assert grew("llmgw_gateway_added_seconds_count") == 5
    assert value(found, "llmgw_gateway_added_seconds_bucket", le="0.1") == value(
        found, "llmgw_gateway_added_seconds_count"
    )
    assert grew("llmgw_gateway_key_requests_total", key="team-a", model="chat") == 4
    assert grew("llmgw_gateway_key_requests_total", key="team-a", model="emb") == 1
    assert grew("llmgw_gateway_key_tokens_total", key="team-a", model="chat") == 4 * 14


def test_requests_in_flight_are_counted_while_they_stream(observed, replicas):
    add_model()
    replica = replicas()
    add_replica("chat", replica.base)
    _, secret = create_key("k")
    until_routed(client(secret), observed.url)
    stream = held_stream(observed.url, secret)
    wait_until(lambda: replica.open_streams == 1, what="the stream to be held")
    assert value(scrape(observed.url), "llmgw_gateway_in_flight", model="chat") == 1
    replica.release.set()
    stream.close()
    wait_until(
        lambda: value(scrape(observed.url), "llmgw_gateway_in_flight", model="chat") == 0, what="the stream to end"
    )


def test_a_replica_that_cannot_be_reached_counts_a_failover(observed, replicas):
    add_model(routing="load")
    add_replica("chat", replicas().base)
    add_replica("chat", f"http://127.0.0.1:{free_port()}/v1")  # nothing listens there
    _, secret = create_key("k")
    session = client(secret)
    wait_until(lambda: len(session.get(observed.url + "/v1/models").json()["data"]) == 1, what="routing")
    until_routed(session, observed.url)
    # Turns alternate between the two, and the dead one is tried last once it failed: one failover in two.
    assert [chat(session, observed.url).status_code for _ in range(2)] == [200, 200]
    assert value(scrape(observed.url), "llmgw_gateway_failovers_total", model="chat") == 1


def test_every_answer_carries_a_request_id_that_reaches_the_engine_and_the_access_log(observed, replicas):
    add_model()
    replica = replicas()
    add_replica("chat", replica.base)
    _, secret = create_key("team-b")
    session = client(secret)
    until_routed(session, observed.url)

    answer = session.post(
        observed.url + "/v1/chat/completions",
        json={"model": "chat", "messages": []},
        headers={"X-Request-Id": "trace-42.abc"},
    )
    assert answer.headers["x-request-id"] == "trace-42.abc"
    # PyPI's llama.cpp server refuses an X-Request-Id that is not a UUID: the engine gets one of its own.
    engine_id = replica.headers[-1]["X-Request-Id"]
    assert uuid.UUID(engine_id) and engine_id != "trace-42.abc"

    mine = str(uuid.uuid4())
    passed = session.post(observed.url + "/v1/chat/completions", json={"model": "chat"}, headers={"X-Request-Id": mine})
    assert passed.headers["x-request-id"] == mine and replica.headers[-1]["X-Request-Id"] == mine

    made = chat(session, observed.url)
    new_id = made.headers["x-request-id"]
    assert len(new_id) == 32 and uuid.UUID(new_id) and new_id not in ("trace-42.abc", mine)
    assert replica.headers[-1]["X-Request-Id"] == new_id
    # A header that could forge a log line is replaced, not passed on.
    forged = session.post(
        observed.url + "/v1/chat/completions", json={"model": "chat"}, headers={"X-Request-Id": 'a"b'}
    )
    assert forged.headers["x-request-id"] != 'a"b'
    refused = requests.post(observed.url + "/v1/chat/completions", json={"model": "chat"})
    assert refused.status_code == 401 and refused.headers["x-request-id"]

    wanted = {"trace-42.abc", mine, new_id, refused.headers["x-request-id"]}
    wait_until(
        lambda: len(access_lines(observed.log)) >= 5
        and wanted <= {line["request_id"] for line in access_lines(observed.log)},
        what=lambda: f"the access log lines of {sorted(wanted)}: {[line['request_id'] for line in access_lines(observed.log)]}",
    )
    lines = {line["request_id"]: line for line in access_lines(observed.log)}
    line = lines["trace-42.abc"]
    assert line["model"] == "chat" and line["key"] == "team-b" and line["status"] == 200
    assert line["engine_request_id"] == engine_id and lines[mine]["engine_request_id"] is None
    assert line["replica"] == int(answer.headers["x-llmgw-replica"])
    assert line["prompt_tokens"] == 11 and line["completion_tokens"] == 3
    assert line["duration_ms"] > 0 and line["gateway_ms"] >= 0 and line["kind"] == "chat"
    assert lines[refused.headers["x-request-id"]]["status"] == 401
    # Never the request's content.
    assert "messages" not in observed.log.read_text() and "content" not in observed.log.read_text()


def test_answers_are_counted_per_hour_in_redis_for_the_overviews_last_24_hours(observed, replicas, redis_client):
    # A model of its own: the hour's counts in the session's Redis hold other tests' models too.
    add_model("hourly")
    add_replica("hourly", replicas().base)
    _, secret = create_key("k")
    session = client(secret)
    until_routed(session, observed.url, model="hourly")
    for _ in range(3):
        assert chat(session, observed.url, model="hourly").status_code == 200
    hour = HOUR_PREFIX + time.strftime("%Y%m%d%H", time.gmtime())

    def counted():
        return redis_client.hgetall(hour)

    # Written within a second of the last answer, with no further request to carry it.
    found = wait_until(
        lambda: counted().get(b"hourly\trequests") == b"3" and counted(),
        timeout=5,
        what=lambda: f"the hour: {counted()}",
    )
    assert found[b"hourly\tprompt"] == b"33" and found[b"hourly\tcompletion"] == b"9"
