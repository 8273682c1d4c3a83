"""The catalog and serve API over real HTTP: who may call it, and what it says."""

from html.parser import HTMLParser

import pytest
import requests

from catalog.models import Model
from fleet.enrolment import issue_token
from fleet.models import Node
from mirror import scan

from .staff_api import staff_session, token_session
from .support.mirror import put

pytestmark = pytest.mark.django_db(transaction=True)

MB = 1 << 20


@pytest.fixture
def mirrored(mirror_root, settings):
    """A 3-file GGUF version and a single-file one in the mirror, indexed."""
    settings.BYTES_URL = "http://127.0.0.1:8001/"
    put(mirror_root, "qwen", "q4", {f"qwen-0000{i}-of-00003.gguf": b"x" * MB for i in (1, 2, 3)})
    put(mirror_root, "notes", "v1", {"a.txt": b"a", "b.txt": b"b"})
    scan.scan_mirror()


@pytest.fixture
def declared():
    return Model.objects.create(
        name="decl", source="http://127.0.0.1:8001/decl/v/", context_length=1, declared=True, added_by="configuration"
    )


def routes(declared_pk: int) -> list[tuple[str, str]]:
    return [
        ("GET", "/api/catalog/models/"),
        ("POST", "/api/catalog/models/"),
        ("GET", f"/api/catalog/models/{declared_pk}/"),
        ("PUT", f"/api/catalog/models/{declared_pk}/"),
        ("PATCH", f"/api/catalog/models/{declared_pk}/"),
        ("DELETE", f"/api/catalog/models/{declared_pk}/"),
        ("GET", "/api/fleet/nodes/"),
        ("GET", "/api/fleet/nodes/1/"),
        ("PATCH", "/api/fleet/nodes/1/"),
        ("GET", "/api/serve/plan/?model=qwen&version=q4"),
        ("POST", "/api/serve/"),
    ]


def test_anonymous_callers_are_refused_on_every_route(live_server, mirrored, declared):
    Node.objects.create(pk=1, name="n1")
    for method, path in routes(declared.pk):
        r = requests.request(method, live_server.url + path, json={"draining": True, "name": "x"})
        assert r.status_code in (401, 403), (method, path, r.status_code)
        assert "credentials were not provided" in r.json()["detail"]
    page = requests.get(live_server.url + "/serve/qwen/q4/", allow_redirects=False)
    assert page.status_code == 302 and "/admin/login/" in page.headers["Location"]
    assert Model.objects.count() == 1 and not Node.objects.get(pk=1).draining


def test_a_nodes_enrolment_token_cannot_use_staff_routes(live_server, mirrored, declared):
    node_token = issue_token("n1")
    for method, path in routes(declared.pk):
        for header in (f"Token {node_token}", f"Bearer {node_token}"):
            r = requests.request(
                method, live_server.url + path, json={"draining": True}, headers={"Authorization": header}
            )
            assert r.status_code in (401, 403), (method, path, header, r.status_code)
    assert not Node.objects.get(name="n1").draining


def test_a_user_who_is_not_staff_is_refused(live_server, mirrored, declared):
    session = staff_session("bob", staff=False)
    assert session.get(live_server.url + "/api/catalog/models/").status_code == 403
    assert session.get(live_server.url + "/api/serve/plan/?model=qwen&version=q4").status_code == 403


class InputValues(HTMLParser):
    def __init__(self):
        super().__init__()
        self.values: dict[str, str] = {}
        self._select: str | None = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "input" and attrs.get("name"):
            self.values[attrs["name"]] = attrs.get("value") or ""
        elif tag == "select":
            self._select = attrs.get("name")
        elif tag == "option" and self._select and "selected" in attrs:
            self.values[self._select] = attrs.get("value") or ""


def test_the_plans_json_is_what_the_page_prefills(live_server, mirrored):
    Node.objects.create(name="small", memory_gb=4, engines=["llamacpp"])
    plan = token_session().get(live_server.url + "/api/serve/plan/?model=qwen&version=q4").json()
    assert plan["source"] == "http://127.0.0.1:8001/qwen/q4/"
    assert (plan["engine"], plan["profile"], plan["files"], plan["min_memory_gb"]) == ("llamacpp", "cpu", 3, 2)
    assert plan["refusal"] == "" and plan["warning"] == ""

    page = staff_session().get(live_server.url + "/serve/qwen/q4/")
    assert page.status_code == 200
    parser = InputValues()
    parser.feed(page.text)
    prefilled = parser.values
    assert prefilled["name"] == plan["model"]
    assert prefilled["source"] == plan["source"]
    assert prefilled["engine"] == plan["engine"]
    assert prefilled["profile"] == plan["profile"]
    assert prefilled["min_memory_gb"] == str(plan["min_memory_gb"])
    assert f"{plan['files']} files" in page.text


def test_the_plan_of_a_version_nothing_reads_is_a_refusal(live_server, mirrored):
    plan = token_session().get(live_server.url + "/api/serve/plan/?model=notes&version=v1").json()
    assert plan["refusal"] == "nothing here reads .txt files"


def test_the_plan_of_a_version_that_is_not_there_says_so(live_server, mirrored):
    api = token_session()
    r = api.get(live_server.url + "/api/serve/plan/?model=qwen&version=nope")
    assert r.status_code == 404 and r.json()["error"] == "the mirror has no version qwen/nope"
    assert api.get(live_server.url + "/api/serve/plan/").status_code == 400


SERVE_FORM = {
    "name": "qwen",
    "source": "http://127.0.0.1:8001/qwen/q4/",
    "context_length": "4096",
    "replicas": "1",
    "engine": "llamacpp",
    "profile": "cpu",
    "ctx_size": "8192",
    "min_memory_gb": "3",
}


def test_post_serve_adds_the_model_with_who_added_it(live_server, mirrored):
    r = token_session("robot").post(live_server.url + "/api/serve/", json=SERVE_FORM)
    assert r.status_code == 201, r.text
    body = r.json()
    assert (body["name"], body["added_by"], body["declared"]) == ("qwen", "robot", False)
    assert body["profiles"][0]["args"] == ["--ctx-size", "8192"]
    model = Model.objects.get(name="qwen")
    assert model.profiles.get().min_memory_gb == 3


@pytest.mark.parametrize(
    "changes, field, sentence",
    [
        ({"replicas": "two"}, "replicas", "the replica count must be a whole number"),
        ({"name": ""}, "name", "a model needs a name and a source"),
        ({"engine": ""}, "engine", "which engine should run it?"),
        (
            {"source": "http://attacker.example/qwen/q4/"},
            "source",
            "the source must be an address on the byte listener",
        ),
        ({"name": "decl"}, "name", "a model called decl is declared in configuration; edit it there rather"),
    ],
)
def test_post_serve_with_a_bad_field_says_which_and_writes_nothing(
    live_server, mirrored, declared, changes, field, sentence
):
    r = token_session().post(live_server.url + "/api/serve/", json={**SERVE_FORM, **changes})
    assert r.status_code == 400
    assert r.json()["field"] == field
    assert r.json()["error"].startswith(sentence)
    assert list(Model.objects.values_list("name", flat=True)) == ["decl"]


CATALOG_ENTRY = {
    "name": "made-here",
    "aliases": ["mh"],
    "source": "http://127.0.0.1:8001/made-here/v1/",
    "context_length": 2048,
    "profiles": [{"name": "cpu", "engine": "llamacpp", "args": ["--ctx-size", "4096"]}],
}


def test_the_catalog_api_creates_reads_updates_and_deletes_a_model_added_here(live_server, mirrored):
    api, url = token_session("robot"), live_server.url + "/api/catalog/models/"
    created = api.post(url, json=CATALOG_ENTRY)
    assert created.status_code == 201, created.text
    assert created.json()["added_by"] == "robot"
    detail = f"{url}{created.json()['id']}/"
    assert api.get(detail).json()["profiles"][0]["engine"] == "llamacpp"
    patched = api.patch(detail, json={"scaling_max": 3, "profiles": [{"name": "gpu", "engine": "vllm", "gpus": 1}]})
    assert patched.status_code == 200, patched.text
    model = Model.objects.get(name="made-here")
    assert model.scaling_max == 3
    assert list(model.profiles.values_list("name", "gpus")) == [("gpu", 1)]
    assert api.delete(detail).status_code == 204
    assert not Model.objects.filter(name="made-here").exists()


@pytest.mark.parametrize(
    "changes, field, sentence",
    [
        ({"aliases": ["decl"]}, "aliases", "the alias decl is already a name or alias of decl"),
        ({"source": "http://127.0.0.1:9999/x/"}, "source", "the source must be an address on the byte listener"),
        ({"profiles": [{"name": "a", "engine": "tgi"}]}, "profiles", None),
        ({"profiles": [{"name": "a", "engine": "vllm", "args": "--x"}]}, "profiles", None),
        (
            {"scaling_min": 3, "scaling_max": 1},
            "scaling_max",
            "the most replicas (1) cannot be fewer than the fewest (3)",
        ),
    ],
)
def test_the_catalog_api_refuses_a_bad_entry_with_a_sentence(live_server, declared, changes, field, sentence):
    r = token_session().post(live_server.url + "/api/catalog/models/", json={**CATALOG_ENTRY, **changes})
    assert r.status_code == 400
    assert field in r.json()
    if sentence:
        assert r.json()[field][0].startswith(sentence)
    assert Model.objects.count() == 1


def test_writing_a_declared_model_is_refused_with_the_reason(live_server, declared):
    api, detail = token_session(), f"{live_server.url}/api/catalog/models/{declared.pk}/"
    for method in ("PATCH", "PUT", "DELETE"):
        r = api.request(method, detail, json={**CATALOG_ENTRY, "name": "decl"})
        assert r.status_code == 403, method
        assert r.json()["detail"] == "decl is declared in configuration (LLMGW_CATALOG); edit it there rather than here"
    declared.refresh_from_db()
    assert declared.context_length == 1
    assert api.get(detail).json()["declared"] is True


def test_the_schema_describes_the_catalog_fleet_and_serve_routes(live_server):
    schema = token_session().get(live_server.url + "/api/schema/?format=json").json()
    for path in ("/api/catalog/models/", "/api/fleet/nodes/", "/api/serve/plan/", "/api/serve/"):
        assert path in schema["paths"]


def page_post(live_server, path: str, form: dict) -> requests.Response:
    """Submit the serve page's form as a browser without JavaScript does, CSRF token and all."""
    session = staff_session()
    session.get(live_server.url + "/serve/qwen/q4/")
    token = session.cookies["csrftoken"]
    return session.post(live_server.url + path, data={**form, "csrfmiddlewaretoken": token}, allow_redirects=False)


def test_a_refused_version_cannot_be_served_by_posting_the_form_anyway(live_server, mirrored):
    r = page_post(
        live_server, "/serve/notes/v1/", {**SERVE_FORM, "name": "notes", "source": "http://127.0.0.1:8001/notes/v1/"}
    )
    assert r.status_code == 400
    assert "nothing here reads .txt files" in r.text
    assert not Model.objects.exists()


def test_the_page_refuses_a_second_model_of_a_declared_name_beside_the_field(live_server, mirrored, declared):
    r = page_post(live_server, "/serve/qwen/q4/", {**SERVE_FORM, "name": "decl"})
    assert r.status_code == 400
    assert 'id="error_name"' in r.text
    assert "a model called decl is declared in configuration; edit it there rather than adding a second" in r.text
    assert list(Model.objects.values_list("name", flat=True)) == ["decl"]


def test_the_page_without_javascript_adds_the_model_and_redirects_to_it(live_server, mirrored):
    r = page_post(live_server, "/serve/qwen/q4/", SERVE_FORM)
    assert r.status_code == 302
    model = Model.objects.get(name="qwen")
    assert r.headers["Location"] == f"/admin/catalog/model/{model.pk}/change/"
    assert model.added_by == "ann"


def test_the_page_of_a_version_that_is_not_in_the_mirror_is_not_found(live_server, mirrored):
    assert staff_session().get(live_server.url + "/serve/qwen/nope/").status_code == 404


def test_post_serve_takes_aliases_as_a_list_and_refuses_a_field_that_is_not_text(live_server, mirrored):
    api = token_session()
    r = api.post(live_server.url + "/api/serve/", json={**SERVE_FORM, "aliases": ["q", "qw"]})
    assert r.status_code == 201, r.text
    assert r.json()["aliases"] == ["q", "qw"]
    r = api.post(live_server.url + "/api/serve/", json={**SERVE_FORM, "name": "other", "replicas": {"min": 1}})
    assert r.status_code == 400
    assert r.json() == {"field": "replicas", "error": "replicas must be written as text or a number"}
    assert Model.objects.count() == 1


def test_the_page_shows_every_bad_fields_sentence_beside_its_field_at_once(live_server, mirrored):
    bad = {**SERVE_FORM, "context_length": "lots", "replicas": "two", "engine": "", "selector_key": "size"}
    r = page_post(live_server, "/serve/qwen/q4/", bad)
    assert r.status_code == 400
    for field, sentence in [
        ("context_length", "the context length must be a whole number"),
        ("replicas", "the replica count must be a whole number"),
        ("engine", "which engine should run it?"),
        ("selector_key", "a node selector needs both a label key and its value"),
    ]:
        assert f'<ul class="errorlist" id="error_{field}"><li>{sentence}</li></ul>' in r.text, field
    assert not Model.objects.exists()


def test_post_serve_names_the_first_of_several_bad_fields_in_the_forms_order(live_server, mirrored):
    r = token_session().post(
        live_server.url + "/api/serve/", json={**SERVE_FORM, "replicas": "two", "context_length": "lots"}
    )
    assert r.status_code == 400
    assert r.json() == {"field": "context_length", "error": "the context length must be a whole number"}
