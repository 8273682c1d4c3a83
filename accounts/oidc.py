"""Sign-in with the organisation's OpenID Connect provider: mozilla-django-oidc, its endpoints found by discovery.

mozilla-django-oidc reads the provider's endpoints from settings; here they come from the
issuer's /.well-known/openid-configuration, read when first needed (not at start, so a
provider that is away stops neither `migrate` nor a local account's login) and kept for
DISCOVERY_TTL_S. Every class here reads them only when it talks to the provider: Django
makes an authentication backend for every password login and for every request's user.
"""

from __future__ import annotations

import logging
import threading
import time

import jwt
import requests
from django.conf import settings
from django.contrib import auth, messages
from django.contrib.auth import get_user_model
from django.core.exceptions import PermissionDenied, SuspiciousOperation
from django.http import HttpResponse, HttpResponseRedirect
from django.urls import reverse
from django.utils.deprecation import MiddlewareMixin
from django.utils.functional import cached_property
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.generic import View
from mozilla_django_oidc import auth as oidc_auth
from mozilla_django_oidc import middleware as oidc_middleware
from mozilla_django_oidc import views as oidc_views

from . import sign_in

log = logging.getLogger(__name__)

DISCOVERY_TTL_S = 3600
# What discovery must name for a sign-in: where the browser goes, where the code is exchanged,
# who the person is, and the keys ID tokens are signed with.
ENDPOINTS = ("authorization_endpoint", "token_endpoint", "userinfo_endpoint", "jwks_uri")


class ProviderUnavailable(Exception):
    """The provider cannot be used now; the message is the sentence a person reads."""


_discovered: tuple[float, dict] | None = None
_discovery_lock = threading.Lock()


def provider() -> dict:
    """The issuer's discovery document, checked; ProviderUnavailable with a sentence when it cannot be had."""
    global _discovered
    with _discovery_lock:
        if _discovered and time.monotonic() - _discovered[0] < DISCOVERY_TTL_S:
            return _discovered[1]
        document = _discover(settings.OIDC_ISSUER)
        _discovered = (time.monotonic(), document)
        return document


def _discover(issuer: str) -> dict:
    url = issuer + "/.well-known/openid-configuration"
    name = settings.OIDC_PROVIDER_NAME
    try:
        answer = requests.get(url, timeout=settings.OIDC_TIMEOUT)
        answer.raise_for_status()
        document = answer.json()
    except (requests.RequestException, ValueError) as error:
        log.warning("the provider's discovery at %s failed: %s", url, error)
        raise ProviderUnavailable(
            f"Sign-in with {name} is not available now: llmgw could not read its configuration at {url} "
            f"({type(error).__name__}). Try again shortly, or sign in with a local account."
        ) from None
    if not isinstance(document, dict) or document.get("issuer") != issuer:
        # OpenID Connect Discovery 4.3: a document naming another issuer is not this provider's.
        raise ProviderUnavailable(
            f"Sign-in with {name} is not available: its configuration at {url} names the issuer "
            f"{document.get('issuer') if isinstance(document, dict) else None!r}, not LLMGW_OIDC_ISSUER {issuer!r}."
        )
    missing = [key for key in ENDPOINTS if not isinstance(document.get(key), str)]
    if missing:
        raise ProviderUnavailable(
            f"Sign-in with {name} is not available: its configuration at {url} names no {', '.join(missing)}."
        )
    return document


def _endpoint(key: str):
    return property(lambda self: provider()[key])


class ProviderBackend(oidc_auth.OIDCAuthenticationBackend):
    """The provider's people: found by their subject, made on first sign-in, updated from the claims every time."""

    OIDC_OP_TOKEN_ENDPOINT = _endpoint("token_endpoint")
    OIDC_OP_USER_ENDPOINT = _endpoint("userinfo_endpoint")
    OIDC_OP_JWKS_ENDPOINT = _endpoint("jwks_uri")

    def __init__(self, *args, **kwargs):
        # Not the library's: it would read the endpoints here, for every password login too.
        self.UserModel = get_user_model()
        self.OIDC_RP_CLIENT_ID = settings.OIDC_RP_CLIENT_ID
        self.OIDC_RP_CLIENT_SECRET = settings.OIDC_RP_CLIENT_SECRET
        self.OIDC_RP_SIGN_ALGO = settings.OIDC_RP_SIGN_ALGO
        self.OIDC_RP_IDP_SIGN_KEY = None

    def authenticate(self, request, **kwargs):
        if request is None or "code" not in request.GET or "nonce" not in kwargs:
            return None  # a password login, or anyone else's: not the provider's callback
        return super().authenticate(request, **kwargs)

    def verify_token(self, token, **kwargs):
        """The library checks the signature, expiry and nonce; the issuer and audience are checked here."""
        payload = super().verify_token(token, **kwargs)
        if payload.get("iss") != settings.OIDC_ISSUER:
            raise SuspiciousOperation(
                f"the ID token was issued by {payload.get('iss')!r}, not {settings.OIDC_ISSUER!r}"
            )
        audience = payload.get("aud")
        if self.OIDC_RP_CLIENT_ID not in ([audience] if isinstance(audience, str) else audience or []):
            raise SuspiciousOperation(f"the ID token is for {audience!r}, not this client ({self.OIDC_RP_CLIENT_ID!r})")
        return payload

    def get_userinfo(self, access_token, id_token, payload):
        """The ID token's claims with the userinfo endpoint's over them: a provider may put groups in either."""
        userinfo = super().get_userinfo(access_token, id_token, payload)
        if not isinstance(userinfo, dict) or userinfo.get("sub") != payload.get("sub"):
            raise SuspiciousOperation("the provider's userinfo is about another subject than its ID token")
        return {**payload, **userinfo}

    def verify_claims(self, claims) -> bool:
        return isinstance(claims.get("sub"), str) and bool(claims["sub"])

    def filter_users_by_claims(self, claims):
        user = sign_in.find_user(settings.OIDC_ISSUER, claims)
        return self.UserModel.objects.filter(pk=user.pk) if user else self.UserModel.objects.none()

    def create_user(self, claims):
        return self.update_user(sign_in.make_user(settings.OIDC_ISSUER, claims), claims)

    def update_user(self, user, claims):
        return sign_in.apply_claims(user, claims, settings.OIDC_GROUPS_CLAIM, sign_in.Mapping.from_settings())


def login_page() -> str:
    return reverse("admin:login")


class SignIn(oidc_views.OIDCAuthenticationRequestView):
    """/oidc/authenticate/: to the provider, with state, nonce and PKCE kept in the session."""

    OIDC_OP_AUTH_ENDPOINT = _endpoint("authorization_endpoint")

    def __init__(self, **kwargs):
        View.__init__(self, **kwargs)
        self.OIDC_RP_CLIENT_ID = settings.OIDC_RP_CLIENT_ID

    def get(self, request):
        try:
            provider()
        except ProviderUnavailable as error:
            messages.error(request, str(error))
            return HttpResponseRedirect(login_page())
        return super().get(request)


class Callback(oidc_views.OIDCAuthenticationCallbackView):
    """/oidc/callback/: the provider's answer. A refusal of any kind is a sentence on the login page."""

    def get(self, request):
        self.failure = None
        if request.GET.get("state") not in request.session.get("oidc_states", {}):
            # Not an answer to this browser's sign-in: a replayed code, a guessed state, or a link
            # someone else made. Nobody is signed in by it, and nobody signed in is signed out by it.
            messages.error(
                request,
                f"Sign-in with {settings.OIDC_PROVIDER_NAME} did not complete: this answer belongs to no sign-in "
                "started in this browser, or it was used already. Start again.",
            )
            return HttpResponseRedirect(login_page())
        try:
            return super().get(request)
        except ProviderUnavailable as error:
            self.failure = str(error)
        except (SuspiciousOperation, PermissionDenied, requests.RequestException, jwt.PyJWTError, ValueError) as error:
            log.warning("sign-in with the provider refused: %s", error)
            self.failure = (
                f"Sign-in with {settings.OIDC_PROVIDER_NAME} did not complete: its answer could not be checked "
                f"({type(error).__name__}). Start again; if it goes on, the admin server's log says why."
            )
        return self.login_failure()

    @property
    def success_url(self) -> str:
        """Where they asked to go, unless it is the admin and they are not staff: then their own page."""
        wanted = self.request.session.pop("oidc_login_next", None)
        staff = self.user.is_staff
        if (
            wanted
            and url_has_allowed_host_and_scheme(wanted, {self.request.get_host()})
            and (staff or not wanted.startswith(reverse("admin:index")))
        ):
            return wanted
        return reverse("admin:index") if staff else settings.OIDC_LANDING

    def login_failure(self):
        if self.request.user.is_authenticated:
            auth.logout(self.request)
        messages.error(self.request, self.failure or self._refusal())
        return HttpResponseRedirect(login_page())

    def _refusal(self) -> str:
        name = settings.OIDC_PROVIDER_NAME
        error = self.request.GET.get("error")
        if error in ("login_required", "interaction_required", "consent_required", "account_selection_required"):
            return (
                f"{name} no longer confirms your sign-in (its answer: {error}): your session there ended or your "
                "account was disabled. Sign in again."
            )
        if error:
            description = self.request.GET.get("error_description", "")[:200]
            return f"{name} refused the sign-in: {error}{': ' + description if description else ''}."
        if getattr(self, "user", None) is not None and not self.user.is_active:
            return "Your llmgw account is disabled: ask an administrator."
        return (
            f"Sign-in with {name} did not complete: llmgw could not confirm who you are with it. "
            "Start again; if it goes on, the admin server's log says why."
        )


class SessionRefresh(oidc_middleware.SessionRefresh):
    """A person signed in by the provider is sent back to it (prompt=none) every LLMGW_OIDC_RENEW_S.

    An enabled person comes back at once without seeing anything, with their groups read
    again; one the provider disabled or signed out comes back refused and is signed out here.
    """

    OIDC_OP_AUTHORIZATION_ENDPOINT = _endpoint("authorization_endpoint")

    def __init__(self, get_response):
        MiddlewareMixin.__init__(self, get_response)
        self.OIDC_EXEMPT_URLS = getattr(settings, "OIDC_EXEMPT_URLS", [])
        self.OIDC_RP_CLIENT_ID = settings.OIDC_RP_CLIENT_ID
        self.OIDC_STATE_SIZE = 32
        self.OIDC_AUTHENTICATION_CALLBACK_URL = "oidc_authentication_callback"
        self.OIDC_RP_SCOPES = settings.OIDC_RP_SCOPES
        self.OIDC_USE_NONCE = True
        self.OIDC_NONCE_SIZE = 32

    @cached_property
    def exempt_urls(self) -> set[str]:
        return {reverse("oidc_authentication_init"), reverse("oidc_authentication_callback")}

    def process_request(self, request):
        if not self.is_refreshable_url(request):
            return None
        try:
            provider()
        except ProviderUnavailable as error:
            # Nobody can say the person is still allowed: out, with why; local accounts still work.
            auth.logout(request)
            messages.error(request, str(error))
            return HttpResponseRedirect(login_page())
        response = super().process_request(request)
        if response is not None and request.headers.get("HX-Request") == "true":
            # A fragment's request cannot follow a redirect to another site: the whole page goes instead.
            return HttpResponse(status=204, headers={"HX-Refresh": "true"})
        return response
