"""Staff input without bounds, and malformed requests: each a sentence in its own shape, never a 500."""

import pytest
import requests

from catalog.models import Model
from gateway.keys import create_key

from .support.factories import add_model, add_replica, new_model
from .support.gateway import client, error_of, until_routed

pytestmark = pytest.mark.django_db(transaction=True)

NESTED = "[" * 100_000 + "]" * 100_000


def test_a_20_mb_description_is_refused_with_a_sentence_and_nothing_is_written(api):
    r = api.post(api.base + "/api/catalog/models/", json=new_model(description="x" * (20 << 20)), timeout=60)
    assert r.status_code == 400
    assert r.json()["description"] == ["Ensure this field has no more than 4000 characters."]
    assert not Model.objects.exists()
    assert api.post(api.base + "/api/catalog/models/", json=new_model(description="short")).status_code == 201


@pytest.mark.parametrize(
    "fields, field, sentence",
    [
        ({"aliases": [f"a{i}" for i in range(101)]}, "aliases", "a model may have at most 100 aliases"),
        (
            {"profiles": [{"name": "cpu", "engine": "llamacpp", "args": ["--x"] * 101}]},
            "profiles",
            "a profile may have at most 100 engine arguments",
        ),
        (
            {"profiles": [{"name": "cpu", "engine": "llamacpp", "args": ["y" * 1001]}]},
            "profiles",
            "an engine argument may be at most 1000 characters",
        ),
    ],
)
def test_lists_and_their_items_have_bounds(api, fields, field, sentence):
    r = api.post(api.base + "/api/catalog/models/", json=new_model(**fields))
    assert r.status_code == 400
    assert sentence in r.text
    assert not Model.objects.exists()


@pytest.mark.parametrize("query", ["limit=99999999999999999999", "offset=99999999999999999999", "limit=-1&offset=-5"])
def test_a_huge_or_odd_page_is_answered_not_a_500(api, query):
    Model.objects.create(name="m", source="http://127.0.0.1:8001/m/v/", context_length=1)
    for path in ("/api/catalog/models/", "/api/fleet/replicas/", "/api/mirror/versions/", "/api/gateway/usage/"):
        r = api.get(f"{api.base}{path}?{query}")
        assert r.status_code == 200, (path, r.status_code, r.text[:200])


def test_json_nested_too_deeply_is_a_400_with_a_sentence_on_the_api(api):
    r = api.post(api.base + "/api/catalog/models/", data=NESTED, headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    assert r.json() == {"detail": "JSON parse error - the request body is nested too deeply"}


def test_the_gateway_answers_odd_bodies_in_openais_shape(gateway):
    add_model()
    add_replica("chat", "http://127.0.0.1:9/v1")
    _, secret = create_key("k")
    session = client(secret)
    until_routed(session, gateway.url)
    nested = session.post(
        gateway.url + "/v1/chat/completions", data=NESTED, headers={"Content-Type": "application/json"}
    )
    assert nested.status_code == 400
    assert error_of(nested)["message"] == "The request body is JSON nested too deeply to read."
    odd = session.post(
        gateway.url + "/v1/chat/completions",
        json={"model": "chat", "messages": [], "stream": True, "stream_options": "abc"},
    )
    assert odd.status_code == 400
    assert error_of(odd)["param"] == "stream_options"
    assert requests.get(gateway.url + "/v1/models").status_code == 401
