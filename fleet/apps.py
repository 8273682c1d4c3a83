from django.apps import AppConfig


class FleetConfig(AppConfig):
    name = "fleet"

    def ready(self) -> None:
        # The replica and fetch admins live in their own modules beside fleet/admin.py;
        # the signals are how a catalog change reaches placement.
        from . import admin_fetches, admin_replicas, metrics, signals  # noqa: F401

        metrics.install()  # the fleet's gauges on /metrics, read from the rows at scrape time
