"""/api/audit/: the audit log, read-only, for staff who may read it (auditlog.view_logentry)."""

from __future__ import annotations

from auditlog.models import LogEntry
from django.db.models import Q
from django_filters import rest_framework as filters
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers, viewsets

from . import audit
from .permissions import requires

ACTIONS = {str(label): value for value, label in LogEntry.Action.choices}


class AuditEntrySerializer(serializers.ModelSerializer):
    action = serializers.SerializerMethodField(help_text="create, update or delete.")
    object_type = serializers.SerializerMethodField(help_text="What was changed: APP.MODEL, e.g. gateway.apikey.")
    object_id = serializers.CharField(source="object_pk", help_text="Its primary key.")
    object = serializers.CharField(source="object_repr", help_text="What it was called when it changed.")
    changes = serializers.SerializerMethodField(
        help_text='Each changed field: [before, after] ("" for a secret that was not set, '
        f'"{audit.SECRET}" for one that was; a secret is never written).'
    )
    summary = serializers.SerializerMethodField(help_text='One line; a key or node token rotated says "rotated".')
    who = serializers.SerializerMethodField(
        help_text='The person\'s username (admin, pages, API token), "command: NAME" for a management command, '
        'or "system" for a Celery task (reconcile, autoscale).'
    )
    remote_addr = serializers.IPAddressField(
        allow_null=True, help_text="The address the request came from; null for a command or task."
    )
    timestamp = serializers.DateTimeField(help_text="When.")

    class Meta:
        model = LogEntry
        fields = ["id", "timestamp", "action", "object_type", "object_id", "object", "summary", "changes", "who"]
        fields += ["remote_addr"]

    @extend_schema_field(serializers.ChoiceField(choices=list(ACTIONS)))
    def get_action(self, entry) -> str:
        return str(dict(LogEntry.Action.choices).get(entry.action, entry.action))

    def get_object_type(self, entry) -> str:
        return f"{entry.content_type.app_label}.{entry.content_type.model}"

    @extend_schema_field(
        serializers.DictField(child=serializers.ListField(child=serializers.JSONField(), min_length=2, max_length=2))
    )
    def get_changes(self, entry) -> dict:
        return entry.changes_dict or {}

    def get_summary(self, entry) -> str:
        return audit.summary(entry)

    def get_who(self, entry) -> str:
        return audit.who(entry)


class AuditFilter(filters.FilterSet):
    object_type = filters.CharFilter(method="of_type", help_text="APP.MODEL, e.g. gateway.apikey")
    object_id = filters.CharFilter(field_name="object_pk", help_text="the object's primary key")
    who = filters.CharFilter(method="by_who", help_text='a username, "command: NAME" or "system"')
    action = filters.ChoiceFilter(
        method="of_action", choices=[(a, a) for a in ACTIONS], help_text="create, update or delete"
    )
    since = filters.IsoDateTimeFilter(field_name="timestamp", lookup_expr="gte", help_text="from this time (ISO 8601)")
    until = filters.IsoDateTimeFilter(field_name="timestamp", lookup_expr="lt", help_text="before this time (ISO 8601)")

    class Meta:
        model = LogEntry
        fields = ["object_type", "object_id", "who", "action", "since", "until"]

    def of_type(self, queryset, name, value):
        app_label, _, model = value.lower().partition(".")
        return queryset.filter(content_type__app_label=app_label, content_type__model=model)

    def by_who(self, queryset, name, value):
        if value == audit.SYSTEM:
            return queryset.filter(actor__isnull=True).filter(
                Q(additional_data__isnull=True) | ~Q(additional_data__has_key="by")
            )
        if value.startswith("command: "):
            return queryset.filter(actor__isnull=True, additional_data__by=value)
        return queryset.filter(actor__username=value)

    def of_action(self, queryset, name, value):
        return queryset.filter(action=ACTIONS[value])


class AuditEntryViewSet(viewsets.ReadOnlyModelViewSet):
    """Who changed what: every create, change and delete of keys, teams, models, profiles, nodes, scales, fetches
    and pulls, newest first (docs/audit.md). Read-only: nobody edits the log or deletes from it."""

    # Reading is all there is: with the model's permissions a write was refused for want of
    # auditlog.add_logentry, which nobody holds, rather than answered "not allowed" (405).
    permission_classes = [requires("auditlog.view_logentry")]
    serializer_class = AuditEntrySerializer
    queryset = LogEntry.objects.select_related("content_type", "actor").order_by("-timestamp", "-id")
    filterset_class = AuditFilter
