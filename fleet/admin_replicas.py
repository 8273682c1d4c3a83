"""Replicas in the admin: where each model runs, and why a pending one does not.

Read-only: placement writes replicas. Staff change the catalog (or drain a
node), and the reconcile pass follows; the one thing done here is asking for a
replica to be replaced.
"""

import threading

from django.contrib import admin, messages
from django.db import transaction
from django.utils.html import format_html_join

from common.admin import RecordAdmin

from . import engine_stats, reconcile
from .models import Replica, Scale

# The engines' stats read for the page being drawn, by this thread.
_seen = threading.local()


@admin.register(Replica)
class ReplicaAdmin(RecordAdmin):
    list_display = [
        "model_name",
        "profile_name",
        "node",
        "state",
        "engine_load",
        "cause",
        "endpoint",
        "short_reason",
        "since",
    ]
    list_filter = ["state", "node", "model_name"]
    search_fields = ["model_name", "node__name", "reason"]
    list_select_related = ["node"]
    readonly_fields = [
        "model_name",
        "profile_name",
        "node",
        "state",
        "endpoint",
        "reason_lines",
        "since",
        "attempts",
        "source",
        "engine",
        "args",
        "memory_gb",
        "gpus",
        "cause",
        "created",
        "engine_load",
    ]
    exclude = ["reason"]
    actions = ["replace"]

    def changelist_view(self, request, extra_context=None):
        # Read once per page, not once per row: what every replica's engine last said.
        _seen.stats = engine_stats.read()
        return super().changelist_view(request, extra_context)

    def change_view(self, request, object_id, form_url="", extra_context=None):
        _seen.stats = engine_stats.read()
        return super().change_view(request, object_id, form_url, extra_context)

    @admin.display(description="engine")
    def engine_load(self, replica: Replica) -> str:
        """`3 of 4 slots busy, 1 deferred, KV cache 42%, 55 tokens/s`, as the engine counts; "" when it did not say."""
        found = getattr(_seen, "stats", {}).get(replica.pk)
        if found is None:
            return ""
        return (
            f"{found['slots_busy']} of {found['slots']} slots busy, {found['requests_deferred']} deferred, "
            f"KV cache {round(100 * found['kv_cache_used'])}%, {found['tokens_per_second']:g} tokens/s"
        )

    @admin.display(description="why")
    def short_reason(self, replica: Replica) -> str:
        first = replica.reason.splitlines()[0] if replica.reason else ""
        return first if len(first) <= 120 else first[:119] + "…"

    @admin.display(description="why")
    def reason_lines(self, replica: Replica) -> str:
        # An engine's last lines of output are lines: keep them so.
        return format_html_join("", "{}<br>", ((line,) for line in replica.reason.splitlines()))

    # A RecordAdmin: placement writes replicas, and deleting a row would leave its
    # engine running with nobody to stop it.

    @admin.action(description="Stop the selected replicas (placement starts new ones)")
    def replace(self, request, queryset) -> None:
        stopped = 0
        with transaction.atomic():
            # of=self: the changelist joins the node, which may be none, and PostgreSQL
            # refuses to lock the nullable side of an outer join.
            for replica in queryset.select_for_update(of=("self",)).exclude(state=Replica.State.STOPPING):
                if replica.node_id is None:
                    replica.delete()
                    continue
                reconcile.stop(replica, f"stopped by {request.user}")
                stopped += 1
        self.message_user(request, f"{stopped} replica(s) asked to stop.", messages.SUCCESS)


@admin.register(Scale)
class ScaleAdmin(RecordAdmin):
    """The autoscaler's count per model and why it last changed: the control plane's own state.

    A RecordAdmin: the count follows the load; staff change the bounds in the catalog.
    """

    list_display = ["model_name", "replicas", "why", "changed"]
    search_fields = ["model_name"]
    readonly_fields = ["model_name", "replicas", "why", "changed", "last_request", "busy_at"]
