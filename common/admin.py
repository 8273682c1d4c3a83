from auditlog.admin import LogEntryAdmin
from auditlog.filters import ResourceTypeFilter
from auditlog.models import LogEntry
from django.contrib import admin

from . import audit


class RecordAdmin(admin.ModelAdmin):
    """A list of what happened, kept by llmgw itself: staff read it, never add, edit or delete a row.

    Each admin that uses it says in a comment why its rows are not staff's to write.
    """

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


# --- the audit log (docs/audit.md) ----------------------------------------------

admin.site.unregister(LogEntry)


@admin.register(LogEntry)
class AuditEntryAdmin(LogEntryAdmin):
    """The audit log: staff who may read it filter by object type, person and date; nobody edits or deletes it.

    The library's admin let a cascade delete entries; here no door does, not even a superuser's.
    """

    list_display = ["created", "resource_url", "action", "what", "by", "remote_addr"]
    list_filter = ["action", ResourceTypeFilter, ("actor", admin.RelatedOnlyFieldListFilter), "timestamp"]
    readonly_fields = ["created", "resource_url", "action", "by", "remote_addr", "msg"]
    fieldsets = [
        (None, {"fields": ["created", "by", "remote_addr", "resource_url"]}),
        ("Changes", {"fields": ["action", "msg"]}),
    ]

    @admin.display(description="What")
    def what(self, obj) -> str:
        return audit.summary(obj)

    @admin.display(description="By")
    def by(self, obj) -> str:
        return audit.who(obj)

    def has_delete_permission(self, request, obj=None) -> bool:
        return False
