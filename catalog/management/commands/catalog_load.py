from pathlib import Path

from django.conf import settings
from django.core.management.base import CommandError

from catalog import config
from common.audit import AuditedCommand


class Command(AuditedCommand):  # changes it makes are written as this command's (docs/audit.md)
    help = "Make the catalog's declared models match the configuration file (LLMGW_CATALOG, or the path given)."

    def add_arguments(self, parser):
        parser.add_argument("path", nargs="?", help="a catalog YAML file; LLMGW_CATALOG when not given")

    def handle(self, *args, path=None, **options):
        path = Path(path) if path else settings.CATALOG_FILE
        if not path:
            raise CommandError("no catalog file: set LLMGW_CATALOG or give the path")
        try:
            report = config.load(path)
        except config.CatalogFileError as error:
            raise CommandError(str(error)) from None
        self.stdout.write(f"Catalog from {path}: {report.summary()}.")
