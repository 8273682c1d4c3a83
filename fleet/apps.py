from django.apps import AppConfig


class FleetConfig(AppConfig):
    name = "fleet"

    def ready(self) -> None:
        # The replica admin lives in its own module beside fleet/admin.py.
        from . import admin_replicas  # noqa: F401
