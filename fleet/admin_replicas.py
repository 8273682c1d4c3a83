"""Replicas in the admin: where each model runs, and why a pending one does not.

Read-only: placement writes replicas. Staff change the catalog (or drain a
node), and the reconcile pass follows; the one thing done here is asking for a
replica to be replaced.
"""

import threading

from django.contrib import admin, messages
from django.db import transaction
from django.utils.html import format_html, format_html_join

from catalog.memory import GB, MB, checked
from catalog.models import Model
from common import audit
from common.admin import RecordAdmin

from . import engine_stats, memory, reconcile, routing
from .models import MeasuredMemory, Replica, Scale

# What one page of replicas shows of memory, read once for the page (one Redis read, one
# query) rather than once a row: per request, as the admin is shared by its threads.
_page = threading.local()


def _gb(size: int) -> str:
    return f"{size / GB:.1f} GB" if size >= GB else f"{size / MB:.0f} MB"


# The engines' stats read for the page being drawn, by this thread.
_seen = threading.local()


@admin.register(Replica)
class ReplicaAdmin(RecordAdmin):
    list_display = [
        "model_name",
        "profile_name",
        "node",
        "held_shares",
        "state",
        "engine_load",
        "cause",
        "endpoint",
        "memory_asked",
        "memory_estimate",
        "memory_measured",
        "short_reason",
        "since",
    ]
    list_filter = ["state", "node", "model_name"]
    search_fields = ["model_name", "node__name", "reason"]
    list_select_related = ["node"]

    def get_queryset(self, request):
        return super().get_queryset(request).prefetch_related("shares__node")

    @admin.display(description="shares")
    def held_shares(self, replica: Replica) -> str:
        """A replica across several nodes: which node holds which share (its node is the head)."""
        shares = list(replica.shares.all())
        if not shares:
            return "-"
        head = 1 - sum(s.share for s in shares)
        parts = [f"{replica.node.name if replica.node_id else '?'} (head) {head:.0%}"]
        parts += [f"{s.node.name} {s.share:.0%} {s.state}" for s in shares]
        return ", ".join(parts)

    readonly_fields = [
        "model_name",
        "profile_name",
        "node",
        "held_shares",
        "state",
        "endpoint",
        "reason_lines",
        "since",
        "attempts",
        "source",
        "engine",
        "args",
        "memory_gb",
        "memory_estimate",
        "memory_measured",
        "gpus",
        "cause",
        "created",
        "engine_load",
        "routed_here",
    ]
    exclude = ["reason"]
    actions = ["replace"]

    def _memory(self, replicas) -> None:
        rows = list(replicas)
        _page.measured, _ = memory.latest({r.node.name for r in rows if r.node_id})
        _page.headers = memory.headers_for(r.source for r in rows)

    def changelist_view(self, request, extra_context=None):
        # Read once per page, not once per row: what every replica's engine last said.
        _seen.stats = engine_stats.read()
        # A profile whose replicas use more than it asks for: said with the number to raise it to.
        for peak, asked in memory.under_asking():
            self.message_user(request, memory.warning(peak, asked), messages.WARNING)
        return super().changelist_view(request, extra_context)

    def get_changelist_instance(self, request):
        changelist = super().get_changelist_instance(request)
        self._memory(changelist.result_list)
        return changelist

    def get_object(self, request, object_id, from_field=None):
        replica = super().get_object(request, object_id, from_field)
        if replica is not None:
            self._memory([replica])
        return replica

    @admin.display(description="asked")
    def memory_asked(self, replica: Replica) -> str:
        return f"{replica.memory_gb} GB" if replica.memory_gb else "—"

    @admin.display(description="estimate")
    def memory_estimate(self, replica: Replica) -> str:
        headers = getattr(_page, "headers", {}).get(replica.source)
        found = memory.estimate_for(headers, replica.engine, replica.args or ())
        if found is None:
            # Why not, where the weights' header is the reason (not read, unreadable, not numbers).
            problem = checked(headers) if headers else ""
            if isinstance(problem, str) and problem:
                return format_html('<span class="memory-problem" title="{}">—</span>', problem)
            return "—"
        return format_html(
            '<span title="weights {} + KV cache {} (pool {}) + prompt cache {} + overhead {}">{}</span>',
            _gb(found.weights),
            _gb(found.kv_cache),
            found.pool,
            _gb(found.prompt_cache),
            _gb(found.overhead),
            _gb(found.total),
        )

    @admin.display(description="measured")
    def memory_measured(self, replica: Replica) -> str:
        m = getattr(_page, "measured", {}).get(replica.pk)
        if m is None or not replica.node_id or m.node != replica.node.name:
            return "—"
        parts = [f"RSS {_gb(m.rss)}"]
        if m.pss is not None:
            parts.append(f"PSS {_gb(m.pss)}")
        if m.gpu:
            parts.append(f"GPU {_gb(m.gpu)}")
        return format_html('<span class="memory-measured">{}</span>', " · ".join(parts))

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

    @admin.display(description="requests routed here")
    def routed_here(self, replica: Replica) -> str:
        """Why the gateways sent requests here (gateway/prefix.py): the last 24 hours by reason, and the latest."""
        counts, latest = routing.routed_to(replica.pk)
        if not counts:
            return "None in the last 24 hours, as the gateways count them."
        said = ", ".join(f"{n} by {reason}" for reason, n in sorted(counts.items(), key=lambda item: -item[1]))
        rows = format_html_join(
            "",
            "<tr><td>{}</td><td>{}</td><td class='route'>{}</td><td>{}</td><td>{}</td></tr>",
            (
                (
                    routing.when(r.get("at")),
                    r.get("model", ""),
                    r.get("route", ""),
                    r.get("prompt", 0),
                    r.get("cached", 0),
                )
                for r in latest
            ),
        )
        return format_html(
            '<p class="routed-counts">Last 24 hours: {}.</p><table class="routed-latest"><thead><tr><th>at (UTC)</th>'
            "<th>model</th><th>why here</th><th>prompt tokens</th><th>from the cache</th></tr></thead>"
            "<tbody>{}</tbody></table>",
            said,
            rows,
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

    # Stopping a replica is the one change staff make to the rows placement writes.
    def has_replace_permission(self, request) -> bool:
        return request.user.has_perm("fleet.change_replica")

    @admin.action(description="Stop the selected replicas (placement starts new ones)", permissions=["replace"])
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


@admin.register(MeasuredMemory)
class MeasuredMemoryAdmin(RecordAdmin):
    """The most each model's profile has been measured to use, and its last bench result.

    A RecordAdmin: heartbeats and `manage.py bench_replica` write it; staff change the profile.
    """

    list_display = [
        "model_name",
        "profile_name",
        "measured",
        "asked",
        "node_name",
        "replica_id",
        "measured_at",
        "bench_at",
    ]
    search_fields = ["model_name"]
    readonly_fields = [
        "model_name",
        "profile_name",
        "source",
        "engine",
        "args",
        "measured",
        "rss_bytes",
        "gpu_bytes",
        "node_name",
        "replica_id",
        "measured_at",
        "bench_table",
        "bench_at",
    ]
    actions = ["set_target_load"]

    # What the action writes is the catalog's model.
    def has_set_target_load_permission(self, request) -> bool:
        return request.user.has_perm("catalog.change_model")

    @admin.action(
        description="Set each model's target load per replica from its last bench", permissions=["set_target_load"]
    )
    def set_target_load(self, request, queryset) -> None:
        for record in queryset:
            suggested = (record.bench or {}).get("suggested_target_load")
            if not suggested:
                self.message_user(request, f"{record}: no bench yet (manage.py bench_replica)", messages.WARNING)
                continue
            for model in Model.objects.filter(name=record.model_name):  # update() tells the audit log nothing
                audit.record_update(model, {"target_load": [model.target_load, int(suggested)]})
            Model.objects.filter(name=record.model_name).update(target_load=int(suggested))
            self.message_user(request, f"The target load of {record.model_name} is now {suggested}.", messages.SUCCESS)

    def changelist_view(self, request, extra_context=None):
        for peak, asked in memory.under_asking():
            self.message_user(request, memory.warning(peak, asked), messages.WARNING)
        return super().changelist_view(request, extra_context)

    @admin.display(description="measured", ordering="host_bytes")
    def measured(self, obj: MeasuredMemory) -> str:
        return _gb(obj.host_bytes)

    @admin.display(description="asked")
    def asked(self, obj: MeasuredMemory) -> str:
        gb = memory.asked_gb(obj)
        if gb is None:
            return "—"
        return f"{gb} GB (raise to {obj.host_gb})" if obj.host_gb > gb else f"{gb} GB"

    @admin.display(description="last bench")
    def bench_table(self, obj: MeasuredMemory) -> str:
        levels = (obj.bench or {}).get("levels") or []
        if not levels:
            return "not run yet: manage.py bench_replica MODEL"
        rows = (
            (
                level.get("concurrency"),
                f"{level.get('tokens_per_s', 0):.1f}",
                f"{level.get('ttft_p50_ms', 0):.0f}",
                _gb(level.get("memory_bytes") or 0),
            )
            for level in levels
        )
        body = format_html_join("", "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>", rows)
        return format_html(
            '<table id="bench"><tr><th>concurrent</th><th>tokens/s</th><th>TTFT p50 (ms)</th><th>memory</th></tr>{}'
            '</table><p>Suggested target load per replica: <strong id="suggested-target-load">{}</strong> '
            "(set it with this list's action, or manage.py bench_replica --set-target-load)</p>",
            body,
            obj.bench.get("suggested_target_load", "—"),
        )
