"""`manage.py check --deploy`'s checks of llmgw's own: a fleet needs a secret key of its own.

Django's security.W009 only warns, and passes any long key: the example's placeholder in
deploy/env/control.env passed. Whoever knows the key forges sessions, so these are errors.
"""

from django.conf import settings
from django.core.checks import Error, Tags, register

# What the examples in deploy/env/ say instead of a key; tests/test_deploy.py checks they still do.
PLACEHOLDER_MARK = "change-me"
SHORTEST_KEY = 50
MAKE_ONE = "make one with python3 -c 'import secrets; print(secrets.token_urlsafe(50))' (docs/fleet.md)"


@register(Tags.security, deploy=True)
def secret_key_check(app_configs=None, **kwargs) -> list[Error]:
    key = settings.SECRET_KEY
    if getattr(settings, "SECRET_KEY_MADE_HERE", False):
        return [
            Error(
                "DJANGO_SECRET_KEY is not set: this host made its own under LLMGW_VAR, which the fleet's other "
                f"control-plane hosts do not share and a new LLMGW_VAR loses; {MAKE_ONE} and set it in control.env.",
                id="llmgw.E001",
            )
        ]
    if PLACEHOLDER_MARK in key.lower():
        return [
            Error(
                "DJANGO_SECRET_KEY is the example's placeholder from deploy/env/control.env, which anyone can read; "
                f"{MAKE_ONE}.",
                id="llmgw.E002",
            )
        ]
    if len(key) < SHORTEST_KEY or len(set(key)) < 5:
        return [
            Error(
                f"DJANGO_SECRET_KEY has {len(key)} characters, {len(set(key))} of them different: it needs at least "
                f"{SHORTEST_KEY}, random; {MAKE_ONE}.",
                id="llmgw.E003",
            )
        ]
    return []
