"""Staff, other users and nodes as the API sees them: real HTTP against pytest-django's live server."""

from __future__ import annotations

import requests
from django.conf import settings
from django.contrib.auth import get_user_model
from django.test import Client

from accounts import tokens


def staff_session(username: str = "ann", staff: bool = True) -> requests.Session:
    """A requests session logged in as this user (made if new), with a session cookie and CSRF token."""
    User = get_user_model()
    user = User.objects.filter(username=username).first()
    if user is None:
        user = User.objects.create_user(username, password="a long password", is_staff=staff, is_superuser=staff)
    client = Client()
    client.force_login(user)
    session = requests.Session()
    session.cookies.set(settings.SESSION_COOKIE_NAME, client.cookies[settings.SESSION_COOKIE_NAME].value)
    return session


def token_session(username: str = "robot") -> requests.Session:
    User = get_user_model()
    user = User.objects.filter(username=username).first() or User.objects.create_user(
        username, is_staff=True, is_superuser=True
    )
    session = requests.Session()
    session.headers["Authorization"] = f"Token {tokens.issue(user)}"
    return session
