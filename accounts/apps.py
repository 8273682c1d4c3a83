from django.apps import AppConfig


class AccountsConfig(AppConfig):
    name = "accounts"
    verbose_name = "accounts"

    def ready(self) -> None:
        from . import schema  # noqa: F401  (the schema's description of the API token, registered by import)
