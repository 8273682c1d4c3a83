from django.apps import AppConfig


class LauncherConfig(AppConfig):
    """Bringing llmgw up on one machine: `manage.py up`, which `make run` calls."""

    name = "launcher"
