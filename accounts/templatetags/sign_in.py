from django import template
from django.conf import settings

register = template.Library()


@register.simple_tag
def identity_provider() -> str:
    """The organisation's provider's name, or "" when sign-in with one is not configured."""
    return getattr(settings, "OIDC_PROVIDER_NAME", "") if getattr(settings, "OIDC_ISSUER", "") else ""
