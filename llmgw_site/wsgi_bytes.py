"""The byte listener's WSGI entry point: same settings, its own URLconf, no middleware."""

import os

os.environ["LLMGW_ROLE"] = "bytes"
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")

from django.core.wsgi import get_wsgi_application  # noqa: E402

application = get_wsgi_application()
