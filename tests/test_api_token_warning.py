"""`manage.py api_token` says so when the token it prints can do nothing: a staff user in no llmgw group."""

from io import StringIO

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.core.management import call_command
from rest_framework.test import APIClient

from common.permissions import OPERATORS, VIEWERS

pytestmark = pytest.mark.django_db


def api_token(username: str) -> tuple[str, str]:
    out, err = StringIO(), StringIO()
    call_command("api_token", username, stdout=out, stderr=err)
    return out.getvalue().strip(), err.getvalue()


def test_a_staff_user_in_neither_group_is_warned_and_still_gets_the_token_the_api_refuses():
    get_user_model().objects.create_user("loner", password="pw-loner-123", is_staff=True)
    token, warning = api_token("loner")
    assert f'loner is staff but in neither "{VIEWERS}" nor "{OPERATORS}"' in warning
    assert "docs/roles.md" in warning
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Token " + token)
    assert client.get("/api/mirror/versions/").status_code == 403  # what the warning foretold


@pytest.mark.parametrize("group", [VIEWERS, OPERATORS, None])
def test_a_viewer_an_operator_or_a_superuser_gets_the_token_without_a_warning(group):
    User = get_user_model()
    if group is None:
        User.objects.create_superuser("root", "", "pw-root-123")
        name = "root"
    else:
        User.objects.create_user("member", password="pw-member-123", is_staff=True).groups.add(
            Group.objects.get(name=group)
        )
        name = "member"
    token, warning = api_token(name)
    assert warning == ""
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Token " + token)
    assert client.get("/api/mirror/versions/").status_code == 200
