from django.contrib import admin

from .models import ApiToken


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    """Staff see who holds which token and until when, and delete one to revoke it.

    A token is made by `manage.py api_token USERNAME`, which shows it once: the table
    keeps only its hash, so there is nothing here to show or edit.
    """

    list_display = ["prefix", "user", "created", "expires", "last_used"]
    list_filter = ["user"]
    search_fields = ["user__username", "prefix"]
    readonly_fields = ["user", "prefix", "created", "expires", "last_used"]
    exclude = ["key_hash"]

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False
