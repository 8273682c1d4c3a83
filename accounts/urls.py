"""/oidc/: the way to the organisation's provider and back; nothing when no issuer is configured (docs/sign-in.md)."""

from django.conf import settings
from django.urls import path

urlpatterns = []
if getattr(settings, "OIDC_ISSUER", "") and settings.ROLE == "control":
    from .oidc import Callback, SignIn

    # The names mozilla-django-oidc's session refresh reverses.
    urlpatterns = [
        path("authenticate/", SignIn.as_view(), name="oidc_authentication_init"),
        path("callback/", Callback.as_view(), name="oidc_authentication_callback"),
    ]
