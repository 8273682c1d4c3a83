import uvicorn
from django.conf import settings
from django.core.management.base import BaseCommand

from common.ports import add_workers_argument, checked_workers, raise_open_files


class Command(BaseCommand):
    help = (
        "Serve the admin port: the admin, the serve pages and the API, in one uvicorn process or, "
        "with --workers N, in N sharing the port. /v1/ is `manage.py gateway`'s."
    )

    def add_arguments(self, parser):
        add_workers_argument(parser, settings.ADMIN_WORKERS, "admin port", "LLMGW_ADMIN_WORKERS")

    def handle(self, *args, **options):
        workers = checked_workers(options["workers"])
        raise_open_files()
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
