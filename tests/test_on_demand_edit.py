"""Fewest, most, target load, quiet period, idle time and priority: shown and edited in the API,
the admin and the configuration file, each refusal a sentence; the serve page keeps fewest = most."""

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from catalog import config
from catalog.models import Model, Profile

from .support.factories import new_model

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_api_shows_and_edits_the_bounds_and_pace_of_a_models_replicas(api):
    made = api.post(api.base + "/api/catalog/models/", json=new_model())
    assert made.status_code == 201, made.text
    shown = made.json()
    # A new model is held at one replica as before: the pace is there for when most is raised.
    assert {k: shown[k] for k in ("scaling_min", "scaling_max", "target_load", "quiet_s", "idle_s", "priority")} == {
        "scaling_min": 1,
        "scaling_max": 1,
        "target_load": 1,
        "quiet_s": 300,
        "idle_s": 900,
        "priority": 100,
    }
    edit = {"scaling_min": 0, "scaling_max": 4, "target_load": 2, "quiet_s": 60, "idle_s": 120, "priority": 50}
    changed = api.patch(api.base + f"/api/catalog/models/{shown['id']}/", json=edit)
    assert changed.status_code == 200, changed.text
    model = Model.objects.get(name="m")
    assert (model.scaling_min, model.scaling_max, model.target_load, model.quiet_s, model.idle_s, model.priority) == (
        0,
        4,
        2,
        60,
        120,
        50,
    )


@pytest.mark.parametrize(
    "fields, field, sentence",
    [
        (
            {"scaling_min": 3, "scaling_max": 1},
            "scaling_max",
            "the most replicas (1) cannot be fewer than the fewest (3)",
        ),
        ({"target_load": 0}, "target_load", "the target load is requests in flight per replica, at least 1"),
        ({"idle_s": -5}, "idle_s", "Ensure this value is greater than or equal to 0."),
    ],
)
def test_the_api_refuses_bounds_that_cannot_be_with_a_sentence(api, fields, field, sentence):
    made = api.post(api.base + "/api/catalog/models/", json=new_model())
    response = api.patch(api.base + f"/api/catalog/models/{made.json()['id']}/", json=fields)
    assert response.status_code == 400, response.text
    assert response.json()[field] == [sentence]
    model = Model.objects.get(name="m")
    assert (model.scaling_min, model.scaling_max, model.target_load, model.idle_s) == (1, 1, 1, 900)


def admin_client() -> Client:
    user = get_user_model().objects.create_user("ann", password="a long password", is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(user)
    return client


def change_form(model: Model, **fields) -> dict:
    profile = model.profiles.get()
    data = {
        "name": model.name,
        "description": "",
        "aliases": "[]",
        "source": model.source,
        "context_length": model.context_length,
        "max_output": 0,
        "kind": "chat",
        "routing_profile": "chat",
        "scaling_min": model.scaling_min,
        "scaling_max": model.scaling_max,
        "target_load": model.target_load,
        "quiet_s": model.quiet_s,
        "idle_s": model.idle_s,
        "priority": model.priority,
        "added_at_0": "2026-01-01",
        "added_at_1": "00:00:00",
        "profiles-TOTAL_FORMS": "1",
        "profiles-INITIAL_FORMS": "1",
        "profiles-MIN_NUM_FORMS": "1",
        "profiles-MAX_NUM_FORMS": "1000",
        "profiles-0-id": profile.pk,
        "profiles-0-model": model.pk,
        "profiles-0-name": profile.name,
        "profiles-0-engine": profile.engine,
        "profiles-0-args": "[]",
        "profiles-0-weight": 1,
        "profiles-0-priority": 100,
        "profiles-0-min_memory_gb": 0,
        "profiles-0-gpus": 0,
        "profiles-0-parallel": 1,
        "profiles-0-nodes": 1,
        "profiles-0-node_selector": "{}",
    }
    data.update(fields)
    return data


def test_the_admin_edits_the_bounds_and_says_what_is_wrong(settings):
    settings.BYTES_URL = "http://127.0.0.1:8001/"
    model = Model.objects.create(name="m", source="http://127.0.0.1:8001/m/v/", context_length=1024)
    Profile.objects.create(model=model, name="cpu", engine="llamacpp")
    client = admin_client()
    url = f"/admin/catalog/model/{model.pk}/change/"
    page = client.get(url).content.decode()
    for label in ("Fewest replicas", "Most replicas", "Target load", "Quiet period (s)", "Idle time (s)", "Priority"):
        assert label in page, label

    refused = client.post(url, change_form(model, scaling_min=2, scaling_max=1, target_load=0))
    assert refused.status_code == 200
    text = refused.content.decode()
    assert "the most replicas (1) cannot be fewer than the fewest (2)" in text
    assert "the target load is requests in flight per replica, at least 1" in text
    model.refresh_from_db()
    assert (model.scaling_min, model.scaling_max, model.target_load) == (1, 1, 1)

    saved = client.post(url, change_form(model, scaling_min=0, scaling_max=3, target_load=4, idle_s=60, quiet_s=30))
    assert saved.status_code == 302, saved.content.decode()[:3000]
    model.refresh_from_db()
    assert (model.scaling_min, model.scaling_max, model.target_load, model.idle_s, model.quiet_s) == (0, 3, 4, 60, 30)


def test_the_configuration_file_declares_the_pace_and_refuses_a_target_of_zero(tmp_path):
    path = tmp_path / "catalog.yaml"
    path.write_text(
        "models:\n"
        "  - name: m\n"
        "    source: http://127.0.0.1:8001/m/v/\n"
        "    context_length: 1024\n"
        "    scaling: {min: 0, max: 3, target_load: 2, quiet_s: 60, idle_s: 600, priority: 10}\n"
        "    profiles: [{engine: llamacpp}]\n"
    )
    config.load(path)
    model = Model.objects.get(name="m")
    assert (model.scaling_min, model.scaling_max, model.target_load, model.quiet_s, model.idle_s, model.priority) == (
        0,
        3,
        2,
        60,
        600,
        10,
    )
    path.write_text(path.read_text().replace("target_load: 2", "target_load: 0"))
    with pytest.raises(config.CatalogFileError, match="scaling: the target load is requests in flight per replica"):
        config.read(path)
