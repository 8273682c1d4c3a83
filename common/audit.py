"""Who changed what (docs/audit.md): django-auditlog's entries, with who did it whatever the door.

The tracked models and their fields are settings.AUDITLOG_INCLUDE_TRACKING_MODELS: a table in
settings, so no layer imports another to register it. What this module adds to the library:
- a person (admin, pages, API): `AuditMiddleware`, which reads the user when an entry is
  written, not when the request arrives, because DRF authenticates a token inside the view;
- a management command: `by_command("node_token")`, written as "command: node_token";
- a Celery task (reconcile, autoscale): nothing set, read as "system";
- secrets (a key's or a node token's hash): never written, only that they changed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta

from auditlog.context import auditlog_value, set_extra_data
from auditlog.middleware import AuditlogMiddleware
from auditlog.models import LogEntry
from django.conf import settings
from django.core.management.base import BaseCommand
from django.utils import timezone
from django.utils.functional import SimpleLazyObject

SYSTEM = "system"
SECRET = "(secret, not recorded)"
# The masked fields: a change to one of them is a rotation.
SECRET_FIELDS = ("key_hash", "token_hash")


def mask_secret(value: str) -> str:
    """auditlog's mask: the library's default keeps half of the value, and half a hash is too much."""
    return SECRET if value and value != "None" else ""


class AuditMiddleware(AuditlogMiddleware):
    """auditlog's middleware, with the actor read lazily and the address the connection came from.

    DRF authenticates `Authorization: Token` in the view, after every middleware, and sets the
    user on the Django request then: read at request time it was anonymous, and an API change
    had no author. The address is the connection's: X-Forwarded-For is whatever a client
    writes, and the library believed it.
    """

    @staticmethod
    def _get_actor(request):
        return SimpleLazyObject(lambda: AuditlogMiddleware._get_actor(request))

    @staticmethod
    def _get_remote_addr(request):
        return request.META.get("REMOTE_ADDR") or None

    @staticmethod
    def _get_remote_port(request) -> int | None:
        return None


@contextlib.contextmanager
def by_command(name: str) -> Iterator[None]:
    """Entries written inside are by the management command `name`: "command: NAME".

    The library does not put back the context it replaced: without that, `up`'s own changes
    after a `call_command` inside it were nobody's.
    """
    outer = auditlog_value.get(None)
    try:
        with set_extra_data(context_data={"actor": None, "additional_data": {"by": f"command: {name}"}}):
            yield
    finally:
        if outer is not None:
            auditlog_value.set(outer)


class AuditedCommand(BaseCommand):
    """A management command whose changes are written as "command: NAME" (NAME: its module's, as typed)."""

    def execute(self, *args, **options):
        with by_command(type(self).__module__.rsplit(".", 1)[-1]):
            return super().execute(*args, **options)


def record_update(instance, changes: dict[str, list]) -> None:
    """An entry for a change a queryset's update or bulk_update wrote, which the library does not hear."""
    LogEntry.objects.log_create(instance, action=LogEntry.Action.UPDATE, changes=changes)


def who(entry: LogEntry) -> str:
    """The person (their username), the command, or "system" (a Celery task, a migration)."""
    if entry.actor_id:
        return entry.actor.get_username()
    by = (entry.additional_data or {}).get("by") if isinstance(entry.additional_data, dict) else None
    return by or SYSTEM


def summary(entry: LogEntry) -> str:
    """One line: what was done, and a rotation said as such without its secret."""
    action = str(dict(LogEntry.Action.choices).get(entry.action, entry.action))
    changed = list((entry.changes_dict or {}).keys())
    if entry.action != LogEntry.Action.UPDATE:
        return action
    rotated = [f for f in changed if f in SECRET_FIELDS]
    others = [f for f in changed if f not in SECRET_FIELDS]
    words = ["rotated the secret"] if rotated else []
    if others:
        words.append("changed " + ", ".join(others))
    return "; ".join(words) or action


def prune(now=None) -> int:
    """Deletes entries older than LLMGW_AUDIT_DAYS; the number deleted."""
    cutoff = (now or timezone.now()) - timedelta(days=settings.AUDIT_DAYS)
    deleted, _ = LogEntry.objects.filter(timestamp__lt=cutoff).delete()
    return deleted
