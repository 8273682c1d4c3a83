import getpass
import os
import sys
import threading
from pathlib import Path

from django.core.management.base import CommandError

from common.audit import AuditedCommand
from mirror import pull
from mirror.models import MirrorPull

TOKEN_ENV = "LLMGW_PULL_TOKEN"


class Command(AuditedCommand):  # changes it makes are written as this command's (docs/audit.md)
    help = (
        "Copy a version from another llmgw mirror into this one, whole and verified or not at all: "
        "URL is its address on that mirror's byte listener, https://HOST:8001/<model>/<version>/ "
        "(http only with LLMGW_PULL_ALLOW_HTTP=true). "
        "That byte listener serves only its fleet: this site is one of its nodes (--node, with the token "
        f"that site's `manage.py node_token NAME` printed in {TOKEN_ENV} or --token-file, never on the command line)."
    )

    def add_arguments(self, parser):
        parser.add_argument("url", help="the version's address on the other mirror's byte listener")
        parser.add_argument("--node", default="", help="this site's node name at the other site")
        parser.add_argument(
            "--token-file",
            type=Path,
            help=f"a file holding the token the other site issued this node (else {TOKEN_ENV}, else asked for)",
        )
        parser.add_argument(
            "--wait",
            type=int,
            default=pull.WAIT_S,
            help="seconds to wait for the other mirror to offer the version whole (default %(default)s)",
        )

    def handle(self, *args, url, node="", token_file=None, wait=pull.WAIT_S, **options):
        token = self._token(node, token_file)
        try:
            record = pull.start(url, node, token, requested_by=f"manage.py mirror_pull ({getpass.getuser()})")
        except pull.PullError as error:
            raise CommandError(str(error)) from None
        self.stderr.write(f"Pulling {record.model}/{record.version} from {record.url} …")
        done = threading.Event()
        watcher = threading.Thread(target=self._report, args=(record.pk, done), daemon=True)
        watcher.start()
        try:
            record = pull.run(record.pk, wait_s=wait)
        finally:
            done.set()
            watcher.join(timeout=2)
        if record.state != MirrorPull.State.DONE:
            raise CommandError(record.error)
        self.stdout.write(f"Pulled {record.model}/{record.version}: {record.bytes_total:,} bytes, every file verified.")

    def _token(self, node: str, token_file: Path | None) -> str:
        if token_file is not None:
            try:
                return token_file.read_text().strip()
            except OSError as error:
                raise CommandError(f"--token-file {token_file} cannot be read: {error.strerror}") from None
        if os.environ.get(TOKEN_ENV):
            return os.environ[TOKEN_ENV].strip()
        if node and sys.stdin.isatty():
            return getpass.getpass(f"The token the other site issued node {node}: ")
        return ""

    def _report(self, pull_id: int, done: threading.Event) -> None:
        from django.db import connection

        said = ""
        try:
            while not done.wait(2):
                row = MirrorPull.objects.filter(pk=pull_id).first()
                if row is not None and row.description != said:
                    said = row.description
                    self.stderr.write(f"  {said}")
        finally:
            connection.close()
