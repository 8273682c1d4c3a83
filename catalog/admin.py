from django.contrib import admin

from .models import Model, Profile


class ProfileInline(admin.StackedInline):
    model = Profile
    extra = 0
    # A model with no profile has nowhere to run, and placement would say nothing about why.
    min_num = 1
    fields = [
        ("name", "engine"),
        "args",
        ("weight", "priority"),
        ("min_memory_gb", "gpus"),
        ("parallel", "nodes"),
        "node_selector",
    ]

    # A declared model's profiles are in the file too; see ModelAdmin below.
    def has_add_permission(self, request, obj=None) -> bool:
        return not (obj and obj.declared) and super().has_add_permission(request, obj)

    def has_change_permission(self, request, obj=None) -> bool:
        return not (obj and obj.declared) and super().has_change_permission(request, obj)

    def has_delete_permission(self, request, obj=None) -> bool:
        return not (obj and obj.declared) and super().has_delete_permission(request, obj)


@admin.register(Model)
class ModelAdmin(admin.ModelAdmin):
    list_display = ["name", "kind", "alias_list", "engines", "replicas", "context_length", "declared", "added_by"]
    list_filter = ["declared", "kind", "routing_profile"]
    search_fields = ["name", "description", "source"]
    readonly_fields = ["declared", "added_by", "added_at"]
    fieldsets = [
        (None, {"fields": ["name", "description", "aliases", "source"]}),
        (
            "Serving",
            {"fields": [("context_length", "max_output"), "kind", "routing_profile"]},
        ),
        (
            "Replicas",
            {
                "fields": [("scaling_min", "scaling_max"), "target_load", ("quiet_s", "idle_s"), "priority"],
                "description": "The count moves between fewest and most with the load the gateway sees: up at once "
                "when requests wait or the load per ready replica passes the target, down one replica at a time "
                "after the quiet period, and with fewest 0 to none after the idle time.",
            },
        ),
        (
            "Prices (per million tokens; blank: free)",
            {
                "fields": [("price_input", "price_cached_input", "price_output")],
                "description": "What usage is charged at, and what teams' spend budgets count; cached input "
                "without a price of its own is charged at the input price.",
            },
        ),
        ("Where it came from", {"fields": ["declared", "added_by", "added_at"]}),
    ]
    inlines = [ProfileInline]

    def get_queryset(self, request):
        return super().get_queryset(request).prefetch_related("profiles")

    # Declared in LLMGW_CATALOG: the file is the one record of it, so it is
    # edited there, and an edit here would be undone by the next load anyway.
    def has_change_permission(self, request, obj=None) -> bool:
        return not (obj and obj.declared) and super().has_change_permission(request, obj)

    def has_delete_permission(self, request, obj=None) -> bool:
        return not (obj and obj.declared) and super().has_delete_permission(request, obj)

    def save_model(self, request, obj: Model, form, change: bool) -> None:
        if not change:
            obj.added_by = request.user.get_username()
        super().save_model(request, obj, form, change)

    def change_view(self, request, object_id, form_url="", extra_context=None):
        obj = self.get_object(request, object_id)
        if obj is not None and obj.declared:
            self.message_user(
                request, f"Declared in configuration (LLMGW_CATALOG): {obj.name} is edited there, not here.", "info"
            )
        return super().change_view(request, object_id, form_url, extra_context)

    @admin.display(description="aliases")
    def alias_list(self, obj: Model) -> str:
        return ", ".join(obj.aliases) or "—"

    @admin.display(description="engines")
    def engines(self, obj: Model) -> str:
        return ", ".join(sorted({p.engine for p in obj.profiles.all()})) or "—"

    @admin.display(description="replicas")
    def replicas(self, obj: Model) -> str:
        if obj.scaling_min == obj.scaling_max:
            return str(obj.scaling_min)
        return f"{obj.scaling_min}–{obj.scaling_max}"
