from django.conf import settings
from django.core.checks import Error, register

from . import config


@register()
def catalog_file_is_valid(app_configs, **kwargs):
    if not settings.CATALOG_FILE:
        return []
    try:
        config.read(settings.CATALOG_FILE)
    except config.CatalogFileError as error:
        return [Error(f"LLMGW_CATALOG: {error}.", id="catalog.E001")]
    return []
