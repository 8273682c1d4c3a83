from django.contrib.admin.apps import AdminConfig


class LlmgwAdminConfig(AdminConfig):
    default_site = "llmgw_site.admin.LlmgwAdminSite"
