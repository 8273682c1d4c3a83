import resource

import uvicorn
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError


class Command(BaseCommand):
    help = (
        "Serve the admin port: the admin, the serve pages and the API, in one uvicorn process or, "
        "with --workers N, in N sharing the port. /v1/ is `manage.py gateway`'s."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--workers",
            type=int,
            default=settings.ADMIN_WORKERS,
            help="processes answering the admin port (default LLMGW_ADMIN_WORKERS, 1); each is one event "
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
        host, port = settings.ADMIN_ADDR
        uvicorn.run(
            "llmgw_site.asgi:application",
            host=host,
            port=port,
            # uvicorn binds the port once and hands it to each worker process; one
            # process is run in this one, with no supervisor between.
            workers=workers if workers > 1 else None,
            loop="uvloop",
            http="httptools",
            lifespan="on",
            access_log=False,
            backlog=4096,
            timeout_keep_alive=75,
            log_level="info",
        )
