from __future__ import annotations

from rest_framework import authentication, exceptions

from . import tokens


class ApiTokenAuthentication(authentication.BaseAuthentication):
    """`Authorization: Token <key>`, as DRF's TokenAuthentication took it, checked against the hashed tokens."""

    keyword = "Token"

    def authenticate(self, request):
        words = authentication.get_authorization_header(request).split()
        if not words or words[0].lower() != self.keyword.lower().encode():
            return None
        if len(words) != 2:
            raise exceptions.AuthenticationFailed("The Authorization header must be `Token <key>`, one key, no spaces.")
        try:
            key = words[1].decode("ascii")
        except UnicodeDecodeError:
            raise exceptions.AuthenticationFailed("An API token is plain ASCII; this one is not.") from None
        token, problem = tokens.check(key)
        if problem:
            raise exceptions.AuthenticationFailed(problem)
        return token.user, token

    def authenticate_header(self, request) -> str:
        return self.keyword
