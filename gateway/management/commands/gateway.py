import os
import resource
import sys

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError


class Command(BaseCommand):
    help = (
        "Serve the gateway: /v1/ on LLMGW_GATEWAY_ADDR and nothing else, in one uvicorn process or, "
        "with --workers N, in N sharing the port. It needs its table from the database and Redis, "
        "and goes on serving from the last table it read while the database is away."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--workers",
            type=int,
            default=settings.GATEWAY_WORKERS,
            help="processes answering the gateway's port (default LLMGW_GATEWAY_WORKERS, 1); each is one event "
            "loop, so more use more cores. Keys' limits are counted in Redis and usage is added in the "
            "database, so the processes share them.",
        )

    def handle(self, *args, **options):
        workers = options["workers"]
        if workers < 1:
            raise CommandError(f"--workers takes a number of processes, 1 or more, not {workers}.")
        # A thousand streams through the gateway hold two thousand sockets; the
        # usual soft limit of 1024 open files would refuse them long before that.
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 65536, hard))
        host, port = settings.GATEWAY_ADDR
        argv = [sys.executable, "-m", "uvicorn", "llmgw_site.asgi_gateway:application"]
        argv += ["--host", host, "--port", str(port), "--loop", "uvloop", "--http", "httptools"]
        argv += ["--lifespan", "on", "--no-access-log", "--backlog", "4096", "--timeout-keep-alive", "75"]
        argv += ["--log-level", "info"]
        if workers > 1:
            # uvicorn binds the port once and hands it to each worker process.
            argv += ["--workers", str(workers)]
        # The gateway's settings (LLMGW_ROLE=gateway) are not this command's: uvicorn takes over this
        # process with them, so a signal sent to `manage.py gateway` reaches the server itself.
        env = dict(os.environ, LLMGW_ROLE="gateway", DJANGO_SETTINGS_MODULE="llmgw_site.settings")
        sys.stdout.flush()
        os.chdir(settings.BASE_DIR)
        os.execve(sys.executable, argv, env)
