from django.apps import AppConfig
from django.db.models.signals import post_migrate


class CatalogConfig(AppConfig):
    name = "catalog"

    def ready(self) -> None:
        from . import checks  # noqa: F401

        post_migrate.connect(load_declared_models, sender=self)


def load_declared_models(sender, **kwargs) -> None:
    """Load LLMGW_CATALOG whenever the database is migrated, which is how llmgw starts.

    `make run` migrates before it starts anything, so a declared model is in the
    catalog before the first request; `manage.py catalog_load` does the same by hand.
    """
    from django.conf import settings
    from django.core.management.base import CommandError

    from . import config

    if not settings.CATALOG_FILE:
        return
    try:
        report = config.load(settings.CATALOG_FILE)
    except config.CatalogFileError as error:
        raise CommandError(str(error)) from None
    if kwargs.get("verbosity", 1) >= 1:
        print(f"Catalog from {settings.CATALOG_FILE}: {report.summary()}.")
