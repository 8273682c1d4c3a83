import redis
from django.contrib import admin
from django.http import HttpRequest, HttpResponseRedirect
from django.urls import reverse

from common import one_time
from common.admin import RecordAdmin
from fleet.live import redis_client

from .keys import give_secret
from .limits import used_now
from .models import LIMIT_FIELDS, ApiKey, Usage


class UsageInline(admin.TabularInline):
    model = Usage
    fields = ("day", "model_name", "requests", "prompt_tokens", "cached_tokens", "completion_tokens", "spend")
    readonly_fields = fields
    extra = 0
    max_num = 0
    can_delete = False
    ordering = ("-day", "model_name")
    verbose_name_plural = "usage (counted by the engines, written every second or so)"


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ("name", "prefix", "active", "team", "owner", "scope", "expires", "created", "last_used")
    list_filter = ("active", "team")
    # Searching teams needs accounts.view_team, which both staff groups hold (common/migrations/0003).
    autocomplete_fields = ("team",)
    raw_id_fields = ("owner",)
    search_fields = ("name", "prefix")
    readonly_fields = ("prefix", "created", "created_by", "last_used", "used_against_limits")
    fieldsets = (
        (None, {"fields": ("name", "prefix", "model_names", "active", "created", "created_by", "last_used")}),
        (
            "Whose (a team's key counts against the team's budgets too, and uses only the team's models)",
            {"fields": ("team", "owner", "expires")},
        ),
        (
            "Limits (blank for none; enforced by every admin server together)",
            {
                "fields": (
                    ("requests_per_minute", "max_in_flight"),
                    ("tokens_per_minute", "tokens_per_day", "tokens_per_month"),
                )
            },
        ),
        ("Used now", {"fields": ("used_against_limits",)}),
    )
    inlines = [UsageInline]
    actions = ["turn_off", "make_new_secret"]

    @admin.display(description="against its limits")
    def used_against_limits(self, obj: ApiKey) -> str:
        """What the key has used in its current windows, as the gateways count it in Redis."""
        if not obj.pk or not any(obj.limits()):
            return "This key has no limits, so nothing is counted against them."
        try:
            used = used_now(redis_client(), obj.key_hash, obj.team_id)
        except redis.RedisError as error:
            return f"Redis could not be read: {error}"
        lines = []
        for field in LIMIT_FIELDS:
            label = ApiKey._meta.get_field(field).verbose_name
            limit = getattr(obj, field)
            lines.append(f"{label}: {used[field]} of {limit}" if limit else f"{label}: {used[field]} (no limit)")
        return "; ".join(lines) + "."

    @admin.display(description="models")
    def scope(self, obj: ApiKey) -> str:
        return ", ".join(obj.model_names) if obj.model_names else "every model"

    def save_model(self, request: HttpRequest, obj: ApiKey, form, change: bool) -> None:
        if not change:
            obj.created_by = request.user.get_username()
            secret = give_secret(obj)
        super().save_model(request, obj, form, change)
        if not change:
            self._keep(request, obj, secret)

    def response_add(self, request, obj, post_url_continue=None):
        return HttpResponseRedirect(reverse("admin:one-time-secrets"))

    @admin.action(description="Turn the selected keys off (their usage is kept)", permissions=["change"])
    def turn_off(self, request: HttpRequest, queryset) -> None:
        count = 0
        for key in queryset.filter(active=True):  # each saved, not updated: the audit log hears of it
            key.active = False
            key.save(update_fields=["active"])
            count += 1
        self.message_user(request, f"{count} key(s) turned off; the gateway refuses them within a second.")

    @admin.action(
        description="Make a new secret for the selected keys (the old one stops working)", permissions=["rotate"]
    )
    def make_new_secret(self, request: HttpRequest, queryset):
        for key in queryset:
            secret = give_secret(key)
            key.save(update_fields=["prefix", "key_hash"])
            self._keep(request, key, secret)
        return HttpResponseRedirect(reverse("admin:one-time-secrets"))

    # A new secret is a new credential, more than a change of the key's row (docs/roles.md).
    def has_rotate_permission(self, request) -> bool:
        return request.user.has_perm("gateway.rotate_api_key")

    def _keep(self, request: HttpRequest, key: ApiKey, secret: str) -> None:
        # Shown once on its own page: only its hash is kept, so it cannot be shown again.
        one_time.keep(request, f"API key {key.name!r}", secret)


@admin.register(Usage)
class UsageAdmin(RecordAdmin):
    list_display = (
        "day",
        "key",
        "model_name",
        "requests",
        "prompt_tokens",
        "cached_tokens",
        "completion_tokens",
        "total_tokens",
        "spend",
    )
    list_filter = ("day", "model_name", "key")
    date_hierarchy = "day"
    # A RecordAdmin: usage is counted by the gateway, and a bill edited by hand is no bill.
