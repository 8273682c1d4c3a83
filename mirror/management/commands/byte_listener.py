import os
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
        env = dict(os.environ, LLMGW_ROLE="bytes", DJANGO_SETTINGS_MODULE="llmgw_site.settings")
        argv = [
            sys.executable,
            "-m",
            "gunicorn",
            "llmgw_site.wsgi_bytes:application",
            "--bind",
            bind,
            # Threads, so eight nodes fetching at once are eight streams at once
            # rather than a queue; the gthread worker's heartbeat does not depend
            # on a request finishing, so a multi-GB download is never cut.
            "--worker-class",
            "gthread",
            "--workers",
            str(settings.BYTES_WORKERS),
            "--threads",
            str(settings.BYTES_THREADS),
            "--timeout",
            str(settings.BYTES_WORKER_TIMEOUT_S),
            "--graceful-timeout",
            "10",
            "--keep-alive",
            "30",
            "--name",
            "llmgw-bytes",
        ]
        if os.environ.get("LLMGW_ACCESS_LOG"):
            argv += ["--access-logfile", "-"]
        os.execve(sys.executable, argv, env)
