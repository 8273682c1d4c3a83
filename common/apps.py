from django.apps import AppConfig


class CommonConfig(AppConfig):
    """What every control-plane app shares; installed for its migration, which makes the staff groups (docs/roles.md)."""

    name = "common"
    verbose_name = "llmgw"
