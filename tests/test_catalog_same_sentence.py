"""Each catalog rule once: the configuration file refuses what the API refuses, with the same sentence.

Every case is driven both ways: POSTed to /api/catalog/models/ (what the admin and the
serve page ask too, through Model.clean), and written into a catalog file that
`catalog.config.load` reads; the API's sentence must be in the file's error, and
neither writes anything.
"""

from __future__ import annotations

import pytest
import yaml
from django.contrib.auth import get_user_model
from rest_framework.test import APIClient

from accounts import tokens
from catalog import config
from catalog.models import Model

pytestmark = pytest.mark.django_db

SOURCE = "http://127.0.0.1:8001/m/v1/"


@pytest.fixture
def staff_api_client(settings):
    settings.BYTES_URL = "http://127.0.0.1:8001/"
    user = get_user_model().objects.create_user("robot", is_staff=True, is_superuser=True)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Token " + tokens.issue(user))
    return client


def sentences(body) -> list[str]:
    """Every sentence in a 400's body, however nested under fields and profiles."""
    if isinstance(body, str):
        return [body]
    if isinstance(body, dict):
        return [s for value in body.values() for s in sentences(value)]
    if isinstance(body, list):
        return [s for value in body for s in sentences(value)]
    return []


# (what the rule is about, the API's fields, the same model as a file's entry)
CASES = [
    ("a name nobody can type", {"name": "has space"}, {"name": "has space"}),
    ("an alias nobody can ask for", {"aliases": ["a b"]}, {"aliases": ["a b"]}),
    ("an alias listed twice", {"aliases": ["x", "x"]}, {"aliases": ["x", "x"]}),
    ("the model's own name as an alias", {"aliases": ["m"]}, {"aliases": ["m"]}),
    ("most replicas fewer than fewest", {"scaling_min": 3, "scaling_max": 1}, {"scaling": {"min": 3, "max": 1}}),
    ("a target load of 0", {"target_load": 0}, {"scaling": {"target_load": 0}}),
    ("a routing profile that does not exist", {"routing_profile": "sticky"}, {"routing_profile": "sticky"}),
    (
        "engine arguments that are not a list",
        {"profiles": [{"name": "cpu", "engine": "llamacpp", "args": "--ctx-size"}]},
        {"profiles": [{"name": "cpu", "engine": "llamacpp", "args": "--ctx-size"}]},
    ),
    (
        "an engine argument off the allow-list",
        {"profiles": [{"name": "gpu", "engine": "vllm", "args": ["--trust-remote-code"]}]},
        {"profiles": [{"name": "gpu", "engine": "vllm", "args": ["--trust-remote-code"]}]},
    ),
    (
        "a node selector that is not labels",
        {"profiles": [{"name": "cpu", "engine": "llamacpp", "node_selector": ["a"]}]},
        {"profiles": [{"name": "cpu", "engine": "llamacpp", "node_selector": ["a"]}]},
    ),
    (
        "too many aliases",
        {"aliases": [f"a{i}" for i in range(101)]},
        {"aliases": [f"a{i}" for i in range(101)]},
    ),
]


def api_refusal(staff_api_client, fields: dict) -> list[str]:
    body = {
        "name": "m",
        "source": SOURCE,
        "context_length": 1024,
        "profiles": [{"name": "cpu", "engine": "llamacpp"}],
        **fields,
    }
    answer = staff_api_client.post("/api/catalog/models/", body, format="json")
    assert answer.status_code == 400, answer.content
    return sentences(answer.json())


def file_refusal(tmp_path, fields: dict) -> str:
    entry = {"name": "m", "source": SOURCE, "context_length": 1024, "profiles": [{"engine": "llamacpp"}], **fields}
    path = tmp_path / "catalog.yaml"
    path.write_text(yaml.safe_dump({"models": [entry]}))
    with pytest.raises(config.CatalogFileError) as refused:
        config.load(path)
    return str(refused.value)


@pytest.mark.parametrize("rule, api_fields, file_fields", CASES, ids=[c[0] for c in CASES])
def test_the_file_refuses_what_the_api_refuses_with_the_same_sentence(
    staff_api_client, tmp_path, rule, api_fields, file_fields
):
    said = api_refusal(staff_api_client, api_fields)
    assert len(said) == 1, said
    assert said[0] in file_refusal(tmp_path, file_fields)
    assert not Model.objects.exists()


@pytest.mark.parametrize(
    "api_fields, file_fields",
    [
        ({"aliases": ["tiny"]}, {"aliases": ["tiny"]}),  # an alias another model has
        ({"name": "tiny"}, {"name": "tiny"}),  # a name that is another model's alias
    ],
    ids=["an alias another model has", "a name that is another model's alias"],
)
def test_a_name_or_alias_taken_by_a_model_added_here_is_refused_by_both_with_the_same_sentence(
    staff_api_client, tmp_path, api_fields, file_fields
):
    Model.objects.create(name="mine", aliases=["tiny"], source=SOURCE, context_length=1)
    said = api_refusal(staff_api_client, api_fields)
    assert len(said) == 1, said
    assert said[0] in file_refusal(tmp_path, file_fields)
    assert list(Model.objects.values_list("name", flat=True)) == ["mine"]
