import os
import resource
import sys

from django.conf import settings
from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = "Run the byte listener (the mirror's files and manifests) on LLMGW_BYTES_ADDR."

    def add_arguments(self, parser):
        parser.add_argument("--addr", help="HOST:PORT to listen on; default LLMGW_BYTES_ADDR")

    def handle(self, *args, addr=None, **options):
        host, port = settings.BYTES_ADDR
        bind = addr or f"{host}:{port}"
        settings.MIRROR_ROOT.mkdir(parents=True, exist_ok=True)
        # Every connection is a descriptor, and the point is to hold thousands of them.
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or hard > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 65536, hard))
        env = dict(os.environ, LLMGW_ROLE="bytes", DJANGO_SETTINGS_MODULE="llmgw_site.settings")
        argv = [
            sys.executable,
            "-m",
            "gunicorn",
            "llmgw_site.wsgi_bytes:application",
            "--bind",
            bind,
            # gevent, so a client sending its head slowly holds a greenlet, not a thread
            # every download needs (mirror/byte_worker.py says why, and how sendfile stays
            # zero-copy). A head not read within the keep-alive time closes the connection.
            "--worker-class",
            "mirror.byte_worker.ByteWorker",
            "--workers",
            str(settings.BYTES_WORKERS),
            "--worker-connections",
            str(settings.BYTES_CONNECTIONS),
            "--timeout",
            str(settings.BYTES_WORKER_TIMEOUT_S),
            "--graceful-timeout",
            "10",
            "--keep-alive",
            str(settings.BYTES_HEADER_TIMEOUT_S),
            # gunicorn's most: a tracker announce naming its cap of torrents (bytes_views.MAX_INFO_HASHES) fits.
            "--limit-request-line",
            "8190",
            "--name",
            "llmgw-bytes",
        ]
        if settings.BYTES_ACCESS_LOG:
            argv += ["--access-logfile", "-"]
        os.execve(sys.executable, argv, env)
