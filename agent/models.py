"""The control plane's record of fetches: one row per node and source.

Live progress is in Redis under the source's address; this is what remains when
a fetch has finished or failed, reported by the node as a task on `control`
(a node has no database), and what staff asked for and cancelled.
"""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models, transaction
from django.utils import timezone


class FetchQuerySet(models.QuerySet):
    def request(self, node, source: str, user=None) -> Fetch:
        """Ask a node to fetch a source; the task is sent once the row is saved."""
        from celery import current_app

        from . import progress
        from .fetch import cache_path
        from .runtime import node_queue

        # The same checks the node makes, here first: staff get the sentence now,
        # not as a failed fetch a minute later.
        cache_path(source, settings.AGENT_CACHE)
        task_id = str(uuid.uuid4())
        fetch, _ = self.update_or_create(
            node=node,
            source=source,
            defaults={
                "state": Fetch.State.REQUESTED,
                "requested_at": timezone.now(),
                "requested_by": user,
                "task_id": task_id,
                "error": "",
                "finished_at": None,
            },
        )

        def send():
            # A cancel left over from an earlier request must not stop this one.
            progress.clear_cancel(progress.redis_client(), node.name, source)
            current_app.send_task("agent.fetch", args=[source], queue=node_queue(node.name), task_id=task_id)

        transaction.on_commit(send)
        return fetch

    def record(self, node, report: dict) -> Fetch | None:
        """A node's report of a finished, failed or cancelled fetch."""
        source = str(report.get("source") or "")[:1000]
        state = report.get("state")
        if not source or state not in (Fetch.State.COMPLETE, Fetch.State.FAILED, Fetch.State.CANCELLED):
            return None
        fetch = self.filter(node=node, source=source).first() or Fetch(node=node, source=source)
        started = report.get("started")
        if fetch.pk and started and fetch.requested_at and fetch.requested_at.timestamp() > float(started) + 1:
            # The report of a run that began before staff asked again: the newer
            # request is still under way, and its own report will come.
            return fetch
        fetch.state = state
        fetch.error = str(report.get("error") or "")[:2000]
        fetch.path = str(report.get("path") or "")[:1000]
        fetch.bytes_total = max(0, int(report.get("bytes_total") or 0))
        fetch.files_total = max(0, int(report.get("files_total") or 0))
        fetch.seconds = max(0.0, float(report.get("seconds") or 0))
        fetch.finished_at = timezone.now()
        fetch.save()
        return fetch


class Fetch(models.Model):
    class State(models.TextChoices):
        REQUESTED = "requested", "requested"
        COMPLETE = "complete", "complete"
        FAILED = "failed", "failed"
        CANCELLED = "cancelled", "cancelled"

    node = models.ForeignKey("fleet.Node", related_name="fetches", on_delete=models.CASCADE)
    source = models.CharField(
        max_length=1000, help_text="A mirror address: a version ends in /, a single file does not."
    )
    state = models.CharField(max_length=20, choices=State.choices, default=State.REQUESTED)
    requested_at = models.DateTimeField(null=True, blank=True)
    requested_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    # The Celery id of the last request, so a cancel can revoke it before it starts.
    task_id = models.CharField(max_length=64, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    path = models.CharField(max_length=1000, blank=True, help_text="Where the node keeps it.")
    bytes_total = models.BigIntegerField(default=0)
    files_total = models.PositiveIntegerField(default=0)
    seconds = models.FloatField(default=0)
    error = models.TextField(blank=True)

    objects = FetchQuerySet.as_manager()

    class Meta:
        ordering = ["node__name", "source"]
        constraints = [models.UniqueConstraint(fields=["node", "source"], name="agent_fetch_unique")]

    def __str__(self) -> str:
        return f"{self.source} on {self.node}"

    def cancel(self) -> bool:
        """Stop this fetch: revoked if it has not started, stopped between chunks if it has."""
        from celery import current_app

        from . import progress

        if self.state != self.State.REQUESTED:
            return False
        progress.request_cancel(progress.redis_client(), self.node.name, self.source)
        if self.task_id:
            current_app.control.revoke(self.task_id)
        self.state = self.State.CANCELLED
        self.error = "cancelled by staff"
        self.finished_at = timezone.now()
        self.save(update_fields=["state", "error", "finished_at"])
        return True
