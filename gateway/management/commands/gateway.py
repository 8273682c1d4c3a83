import os
import sys

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from common.metrics import fresh_multiprocess_dir
from common.ports import add_workers_argument, checked_workers, raise_open_files
from gateway.prometheus import SHARED_DIR_ENV, shared_dir


class Command(BaseCommand):
    help = (
        "Serve the gateway: /v1/ on LLMGW_GATEWAY_ADDR and nothing else, in one uvicorn process or, "
        "with --workers N, in N sharing the port. It needs its table from the database and Redis, "
        "and goes on serving from the last table it read while the database is away."
    )

    def add_arguments(self, parser):
        add_workers_argument(parser, settings.GATEWAY_WORKERS, "gateway's port", "LLMGW_GATEWAY_WORKERS")

    def handle(self, *args, **options):
        workers = checked_workers(options["workers"])
        raise_open_files()
        host, port = settings.GATEWAY_ADDR
        argv = [sys.executable, "-m", "uvicorn", "llmgw_site.asgi_gateway:application"]
        argv += ["--host", host, "--port", str(port), "--loop", "uvloop", "--http", "httptools"]
        argv += ["--lifespan", "on", "--no-access-log", "--backlog", "4096", "--timeout-keep-alive", "75"]
        argv += ["--log-level", "info", "--limit-concurrency", str(settings.GATEWAY_CONCURRENCY)]
        # The gateway's settings (LLMGW_ROLE=gateway) are not this command's: uvicorn takes over this
        # process with them, so a signal sent to `manage.py gateway` reaches the server itself.
        env = dict(os.environ, LLMGW_ROLE="gateway", DJANGO_SETTINGS_MODULE="llmgw_site.settings")
        env.pop(SHARED_DIR_ENV, None)
        if workers > 1:
            # uvicorn binds the port once and hands it to each worker process.
            argv += ["--workers", str(workers)]
            # Where they share their counts, so each answers /metrics with all of theirs; emptied, as an
            # earlier run's counts would count twice.
            counts_dir = shared_dir(settings.VAR_DIR, host, port)
            try:
                env[SHARED_DIR_ENV] = str(fresh_multiprocess_dir(counts_dir))
            except OSError as error:
                raise CommandError(
                    f"The workers share their counts in {counts_dir}, which could not be made: {error}"
                ) from None
        sys.stdout.flush()
        os.chdir(settings.BASE_DIR)
        os.execve(sys.executable, argv, env)
