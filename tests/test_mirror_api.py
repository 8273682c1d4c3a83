"""The mirror's API: closed to anonymous callers, open to a staff token."""

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from rest_framework.test import APIClient

from mirror import scan

from .support.mirror import put
from .support.roles import join

pytestmark = pytest.mark.django_db


@pytest.fixture
def staff_token():
    from accounts import tokens

    user = join(get_user_model().objects.create_user("ops", password="pw-ops-123", is_staff=True))
    return tokens.issue(user)


@pytest.fixture
def indexed(mirror_root):
    put(mirror_root, "llama", "q4", {"a.gguf": b"1" * 100, "b.gguf": b"2" * 50})
    for file_id in scan.scan_mirror().to_hash:
        scan.hash_file(file_id)


@pytest.mark.parametrize("path", ["/api/mirror/versions/", "/api/schema/"])
def test_anonymous_callers_are_refused(path, indexed):
    response = APIClient().get(path)
    assert response.status_code in (401, 403)


def test_a_user_who_is_not_staff_is_refused(indexed):
    from accounts import tokens

    user = get_user_model().objects.create_user("someone", password="pw-someone-1")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Token " + tokens.issue(user))
    assert client.get("/api/mirror/versions/").status_code == 403


def test_staff_list_versions_with_totals_and_see_a_version_s_files(staff_token, indexed):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Token " + staff_token)
    listing = client.get("/api/mirror/versions/").json()
    assert listing["count"] == 1
    version = listing["results"][0]
    assert (version["model"], version["version"], version["file_count"], version["total_bytes"]) == (
        "llama",
        "q4",
        2,
        150,
    )
    assert version["state"] == "complete"
    assert version["address"].endswith("/llama/q4/")
    detail = client.get(f"/api/mirror/versions/{version['id']}/").json()
    assert [f["name"] for f in detail["files"]] == ["a.gguf", "b.gguf"]
    assert all(len(f["sha256"]) == 64 for f in detail["files"])


def test_the_openapi_schema_describes_the_mirror(staff_token):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Token " + staff_token)
    response = client.get("/api/schema/", HTTP_ACCEPT="application/json")
    assert response.status_code == 200
    assert "/api/mirror/versions/" in response.json()["paths"]


def test_api_token_prints_a_staff_user_s_token(capsys):
    join(get_user_model().objects.create_user("ops", password="pw-ops-123", is_staff=True))
    call_command("api_token", "ops")
    key = capsys.readouterr().out.strip()
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Token " + key)
    assert client.get("/api/mirror/versions/").status_code == 200


def test_api_token_refuses_a_user_who_is_not_staff():
    get_user_model().objects.create_user("someone", password="pw-someone-1")
    with pytest.raises(CommandError, match="not staff"):
        call_command("api_token", "someone")
