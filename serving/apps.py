from django.apps import AppConfig


class ServingConfig(AppConfig):
    """The serve flow: a mirrored version put into service from the serve page or `POST /api/serve/`."""

    name = "serving"
