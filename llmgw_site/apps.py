from django.contrib.admin.apps import AdminConfig


class LlmgwAdminConfig(AdminConfig):
    default_site = "llmgw_site.admin.LlmgwAdminSite"

    def ready(self) -> None:
        super().ready()
        from . import checks  # noqa: F401  (registers llmgw's deploy checks)
