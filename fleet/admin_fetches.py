from django import forms
from django.contrib import admin, messages
from django.db import transaction
from django.http import HttpResponseRedirect
from django.template.defaultfilters import filesizeformat
from django.urls import reverse
from django.utils.html import format_html

from contracts import progress
from contracts.sources import SourceError, cache_parts

from .live import redis_client
from .models import Fetch


class FetchRequestForm(forms.ModelForm):
    """Staff asking for a fetch: a node and a source, checked the way the node will check it."""

    class Meta:
        model = Fetch
        fields = ["node", "source"]

    def clean_source(self):
        source = self.cleaned_data["source"].strip()
        try:
            cache_parts(source)
        except SourceError as error:
            raise forms.ValidationError(str(error)) from None
        return source

    def clean(self):
        cleaned = super().clean()
        existing = Fetch.objects.filter(node=cleaned.get("node"), source=cleaned.get("source")).first()
        if existing is not None:
            # Asking again for the same node and source is a new request of the same row.
            self.instance = existing
        return cleaned


@admin.register(Fetch)
class FetchAdmin(admin.ModelAdmin):
    list_display = ["source", "node", "state", "live", "size", "finished_at", "error_short"]
    list_filter = ["state", "node"]
    search_fields = ["source", "node__name"]
    actions = ["fetch_again", "cancel"]
    readonly_fields = [
        "node",
        "source",
        "state",
        "live",
        "requested_at",
        "requested_by",
        "task_id",
        "finished_at",
        "path",
        "size",
        "files_total",
        "seconds",
        "error",
    ]

    def get_form(self, request, obj=None, **kwargs):
        if obj is None:
            kwargs["form"] = FetchRequestForm
        return super().get_form(request, obj, **kwargs)

    def get_fields(self, request, obj=None):
        return ["node", "source"] if obj is None else self.readonly_fields

    def get_readonly_fields(self, request, obj=None):
        return [] if obj is None else self.readonly_fields

    # What a node did is recorded from its report, never edited by hand.
    def has_change_permission(self, request, obj=None) -> bool:
        return obj is None and super().has_change_permission(request, obj)

    @transaction.atomic
    def save_model(self, request, obj, form, change):
        fetch = Fetch.objects.request(obj.node, obj.source, user=request.user)
        obj.pk = fetch.pk
        obj.refresh_from_db()

    def response_add(self, request, obj, post_url_continue=None):
        self.message_user(request, f"Asked {obj.node} to fetch {obj.source}.", messages.SUCCESS)
        return HttpResponseRedirect(reverse("admin:fleet_fetch_changelist"))

    @admin.display(description="live progress")
    def live(self, obj: Fetch) -> str:
        snapshot = progress.read_one(redis_client(), obj.node.name, obj.source)
        if not snapshot:
            return "-"
        return format_html("{} {:.0f}%", snapshot["state"], progress.percent(snapshot))

    @admin.display(description="size")
    def size(self, obj: Fetch) -> str:
        return filesizeformat(obj.bytes_total) if obj.bytes_total else "-"

    @admin.display(description="error")
    def error_short(self, obj: Fetch) -> str:
        return obj.error[:120]

    @admin.action(description="Fetch again onto the same node", permissions=["add"])
    def fetch_again(self, request, queryset):
        for fetch in queryset.select_related("node"):
            Fetch.objects.request(fetch.node, fetch.source, user=request.user)
        self.message_user(request, f"Asked again for {queryset.count()} fetch(es).", messages.SUCCESS)

    @admin.action(description="Cancel", permissions=["change"])
    def cancel(self, request, queryset):
        cancelled = [f for f in queryset.select_related("node") if f.cancel()]
        skipped = queryset.count() - len(cancelled)
        self.message_user(request, f"Cancelled {len(cancelled)} fetch(es).", messages.SUCCESS)
        if skipped:
            self.message_user(request, f"{skipped} had already finished and were left as they are.", messages.WARNING)
