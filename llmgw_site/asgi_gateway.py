"""The gateway's port (`manage.py gateway`): /v1/ and nothing else, as a bare ASGI application.

No Django request handling: Django is set up only for the models the gateway
reads its table through (LLMGW_ROLE=gateway in settings.py).
"""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")
os.environ.setdefault("LLMGW_ROLE", "gateway")

import django  # noqa: E402

# With --workers each process imports this module afresh, and the gateway's modules use Django's models.
django.setup()

from gateway.app import Gateway  # noqa: E402

application = Gateway()
