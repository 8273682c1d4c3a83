from django.contrib import admin


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
