from django.apps import AppConfig


class MirrorConfig(AppConfig):
    name = "mirror"

    def ready(self) -> None:
        from . import checks  # noqa: F401
