from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from agent import runtime
from agent.fetch import FetchError, fetch_source
from agent.progress import TerminalProgress


class Command(BaseCommand):
    help = (
        "Fetch a file or a mirror version (a source ending in /) into the agent's cache, in the foreground. "
        "The byte listener serves only enrolled nodes: the pass is made from LLMGW_NODE_NAME and LLMGW_NODE_TOKEN."
    )
    # Runs on a node, which has no database: nothing here may need one.
    requires_system_checks = []

    def add_arguments(self, parser):
        parser.add_argument("source", help="http://mirror:8001/<model>/<version>/ or .../<version>/<file>")
        parser.add_argument("--cache", type=Path, help="the cache directory; default LLMGW_AGENT_CACHE")
        parser.add_argument("--quiet", action="store_true", help="no progress bar")
        parser.add_argument(
            "--allow-any-host",
            action="store_true",
            help="fetch from any host, not only this node's byte listener (LLMGW_BYTES_URL): a one-off copy",
        )

    def handle(self, *args, source, cache=None, quiet=False, allow_any_host=False, **options):
        cache = cache or runtime.cache_dir()
        progress = None if quiet else TerminalProgress(source, self.stderr._out)
        try:
            path = fetch_source(source, cache, progress=progress, any_host=allow_any_host)
        except FetchError as error:
            raise CommandError(str(error)) from None
        except KeyboardInterrupt:
            raise CommandError("interrupted; the part is kept and the next fetch resumes from there") from None
        self.stdout.write(str(path))
