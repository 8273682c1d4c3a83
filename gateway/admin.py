from django.contrib import admin, messages
from django.http import HttpRequest

from common.admin import RecordAdmin

from .keys import give_secret
from .models import ApiKey, Usage


class UsageInline(admin.TabularInline):
    model = Usage
    fields = ("day", "model_name", "requests", "prompt_tokens", "completion_tokens")
    readonly_fields = fields
    extra = 0
    max_num = 0
    can_delete = False
    ordering = ("-day", "model_name")
    verbose_name_plural = "usage (counted by the engines, written every second or so)"


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ("name", "prefix", "active", "scope", "created", "last_used")
    list_filter = ("active",)
    search_fields = ("name", "prefix")
    readonly_fields = ("prefix", "created", "created_by", "last_used")
    inlines = [UsageInline]
    actions = ["turn_off", "make_new_secret"]

    @admin.display(description="models")
    def scope(self, obj: ApiKey) -> str:
        return ", ".join(obj.model_names) if obj.model_names else "every model"

    def save_model(self, request: HttpRequest, obj: ApiKey, form, change: bool) -> None:
        if not change:
            obj.created_by = request.user.get_username()
            secret = give_secret(obj)
        super().save_model(request, obj, form, change)
        if not change:
            self._show(request, obj, secret)

    @admin.action(description="Turn the selected keys off (their usage is kept)")
    def turn_off(self, request: HttpRequest, queryset) -> None:
        count = queryset.update(active=False)
        self.message_user(request, f"{count} key(s) turned off; the gateway refuses them within a second.")

    @admin.action(description="Make a new secret for the selected keys (the old one stops working)")
    def make_new_secret(self, request: HttpRequest, queryset) -> None:
        for key in queryset:
            secret = give_secret(key)
            key.save(update_fields=["prefix", "key_hash"])
            self._show(request, key, secret)

    def _show(self, request: HttpRequest, key: ApiKey, secret: str) -> None:
        self.message_user(
            request,
            f"API key {key.name!r}, shown this once and stored only as a hash: {secret}",
            messages.WARNING,
        )


@admin.register(Usage)
class UsageAdmin(RecordAdmin):
    list_display = ("day", "key", "model_name", "requests", "prompt_tokens", "completion_tokens", "total_tokens")
    list_filter = ("day", "model_name", "key")
    date_hierarchy = "day"
    # A RecordAdmin: usage is counted by the gateway, and a bill edited by hand is no bill.
