"""API keys and usage through the DRF API, for automation: staff only, the key shown once."""

import datetime

import pytest
import requests

from gateway.keys import hash_key
from gateway.models import ApiKey, Usage

from .staff_api import staff_session, token_session

pytestmark = pytest.mark.django_db(transaction=True)


def test_automation_makes_a_key_and_sees_it_once(live_server):
    api, url = token_session(), live_server.url + "/api/gateway/keys/"
    made = api.post(url, json={"name": "ci-bot", "models": ["chat"]})
    assert made.status_code == 201, made.text
    secret = made.json()["key"]
    assert ApiKey.objects.get(name="ci-bot").key_hash == hash_key(secret)
    assert made.json()["models"] == ["chat"] and made.json()["created_by"] == "robot"
    listed = api.get(url).json()["results"]
    assert [k["name"] for k in listed] == ["ci-bot"] and secret not in str(listed) and "key" not in listed[0]
    again = api.post(url, json={"name": "ci-bot"})
    assert again.status_code == 400 and "already exists" in str(again.json())


def test_a_key_is_turned_off_not_deleted_and_its_models_must_be_names(live_server):
    api, url = token_session(), live_server.url + "/api/gateway/keys/"
    key = api.post(url, json={"name": "k"}).json()
    assert api.patch(f"{url}{key['id']}/", json={"active": False}).json()["active"] is False
    assert api.delete(f"{url}{key['id']}/").status_code == 405
    assert api.patch(f"{url}{key['id']}/", json={"models": "chat"}).status_code == 400
    assert ApiKey.objects.get(pk=key["id"]).active is False


def test_usage_is_listed_and_filtered_by_key_model_and_day(live_server):
    alice = ApiKey.objects.create(name="alice", prefix="llmgw-a", key_hash="a" * 64)
    bob = ApiKey.objects.create(name="bob", prefix="llmgw-b", key_hash="b" * 64)
    day = datetime.date(2026, 11, 29)
    Usage.objects.create(key=alice, model_name="chat", day=day, requests=2, prompt_tokens=20, completion_tokens=5)
    Usage.objects.create(key=bob, model_name="chat", day=day - datetime.timedelta(days=3), requests=1)
    api, url = token_session(), live_server.url + "/api/gateway/usage/"
    assert len(api.get(url).json()["results"]) == 2
    rows = api.get(url, params={"key": "alice", "model": "chat", "since": "2026-11-28"}).json()["results"]
    assert rows == [
        {
            "key": "alice",
            "model": "chat",
            "day": "2026-11-29",
            "requests": 2,
            "prompt_tokens": 20,
            "completion_tokens": 5,
        }
    ]
    assert api.get(url, params={"since": "yesterday"}).status_code == 400


def test_only_staff_reach_keys_and_usage(live_server):
    for path in ("/api/gateway/keys/", "/api/gateway/usage/"):
        assert requests.get(live_server.url + path).status_code in (401, 403)
        assert staff_session("pat", staff=False).get(live_server.url + path).status_code == 403
