"""The admin port under an ASGI server: the /v1/ gateway on the event loop, Django's pages beside it.

Django's own pages (admin, serve page, API) are plain WSGI run in a pool of
threads, as they were under gunicorn: a slow page never holds up the event
loop, and the gateway's requests never go through Django's handler.
"""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")

from a2wsgi import WSGIMiddleware  # noqa: E402
from django.conf import settings  # noqa: E402
from django.core.wsgi import get_wsgi_application  # noqa: E402

# Sets Django up first: with --workers each process imports this module afresh, and the
# gateway's modules use Django's models.
django_wsgi = get_wsgi_application()

from gateway.app import Gateway  # noqa: E402

django_pages = WSGIMiddleware(django_wsgi, workers=settings.ADMIN_THREADS)
gateway = Gateway()


async def application(scope, receive, send):
    if scope["type"] == "lifespan" or scope["path"] == "/v1" or scope["path"].startswith("/v1/"):
        await gateway(scope, receive, send)
    else:
        await django_pages(scope, receive, send)
