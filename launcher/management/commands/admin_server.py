import resource

import uvicorn
from django.conf import settings
from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = "Serve the admin port: the admin, the serve pages, the API and the /v1/ gateway, in one uvicorn process."

    def handle(self, *args, **options):
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
            loop="uvloop",
            http="httptools",
            lifespan="on",
            access_log=False,
            backlog=4096,
            timeout_keep_alive=75,
            log_level="info",
        )
