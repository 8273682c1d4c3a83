"""The admin port under an ASGI server: Django's pages (admin, serve pages, API) in a pool of threads.

Django's pages are plain WSGI run in threads, as they were under gunicorn: a
slow page never holds up the event loop. /v1/ is not here: the gateway has a
port of its own (`manage.py gateway`, llmgw_site/asgi_gateway.py), so that
clients never need to reach the admin port, and a client still pointed here is
told, in OpenAI's error shape, where the gateway is.
"""

import json
import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")

from a2wsgi import WSGIMiddleware  # noqa: E402
from django.conf import settings  # noqa: E402
from django.core.wsgi import get_wsgi_application  # noqa: E402

django_wsgi = get_wsgi_application()
django_pages = WSGIMiddleware(django_wsgi, workers=settings.ADMIN_THREADS)


def elsewhere(path: str) -> bytes:
    message = (
        f"The gateway is not on the admin port: send {path} to {settings.GATEWAY_URL.rstrip('/')}{path} "
        "(LLMGW_GATEWAY_URL), with the same API key."
    )
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": "gateway_elsewhere"}
    return json.dumps({"error": error}).encode()


async def application(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            await send({"type": message["type"] + ".complete"})
            if message["type"] == "lifespan.shutdown":
                return
    if scope["path"] == "/v1" or scope["path"].startswith("/v1/"):
        body = elsewhere(scope["path"])
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 404, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        return
    await django_pages(scope, receive, send)
