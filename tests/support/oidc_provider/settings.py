"""The test provider's settings: from the environment `start.py` gives it (PROVIDER_*), nothing of llmgw's."""

import os
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent
# The provider's own signing key for its sessions, not llmgw's; it signs nothing llmgw reads.
SECRET_KEY = "the test provider's own session key, nothing of llmgw's"
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]

INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "oauth2_provider",
    "tests.support.oidc_provider",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "tests.support.oidc_provider.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
            ]
        },
    }
]
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": os.environ["PROVIDER_DB"]}}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
# Its pages name a stylesheet; nothing serves it, and nothing is fetched from anywhere else.
STATIC_URL = "static/"

# Browsers keep cookies by host, not port: on 127.0.0.1 beside llmgw its names must differ from llmgw's.
SESSION_COOKIE_NAME = "provider_sessionid"
CSRF_COOKIE_NAME = "provider_csrftoken"
LOGIN_URL = "/accounts/login/"

OAUTH2_PROVIDER = {
    "OIDC_ENABLED": True,
    "OIDC_RSA_PRIVATE_KEY": Path(os.environ["PROVIDER_RSA_KEY"]).read_text()
    if os.environ.get("PROVIDER_RSA_KEY")
    else "",
    "OIDC_ISS_ENDPOINT": os.environ.get("PROVIDER_ISSUER", ""),
    "OAUTH2_VALIDATOR_CLASS": "tests.support.oidc_provider.validators.GroupsValidator",
    "SCOPES": {
        "openid": "Who you are at this provider",
        "email": "Your email address",
        "profile": "Your name",
        "groups": "The groups you are in",
    },
    # The consent screen the first time; a later (silent, prompt=none) request is answered while that grant lasts.
    "REQUEST_APPROVAL_PROMPT": "auto",
    "PKCE_REQUIRED": True,
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": "WARNING"},
}
