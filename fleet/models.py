"""The fleet: the nodes that run replicas, as their agents report them, and what they fetched."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta

from celery import current_app
from django.conf import settings
from django.db import models, transaction
from django.utils import timezone

from contracts import credentials, progress, signing, tasks
from contracts.sources import cache_parts

from .live import redis_client


def heartbeat_deadline(now: datetime | None = None) -> datetime:
    """A node whose last heartbeat is older than this has missed too many to be ready."""
    return (now or timezone.now()) - timedelta(seconds=settings.HEARTBEAT_S * settings.HEARTBEATS_MISSED)


def heard_from_lately(last_heartbeat: datetime | None, now: datetime | None = None) -> bool:
    return last_heartbeat is not None and last_heartbeat >= heartbeat_deadline(now)


class Node(models.Model):
    class State(models.TextChoices):
        READY = "ready", "ready"
        NOT_READY = "not_ready", "not ready"
        DRAINING = "draining", "draining"

    name = models.CharField(max_length=100, unique=True)
    labels = models.JSONField(default=dict, blank=True, help_text="key: value, used by profiles' node selectors")
    engines = models.JSONField(default=list, blank=True, help_text="engines the agent found installed and working")
    # Installed but failed the agent's self-test (a build that crashes on this CPU, say):
    # {engine: why}. Not in `engines`, so placement never puts a replica on them.
    engines_unusable = models.JSONField(
        "unusable engines", default=dict, blank=True, help_text="engines installed but failing their self-test, and why"
    )
    gpus = models.JSONField(default=list, blank=True, help_text="GPUs the agent reports: [{name, memory_mb}]")
    memory_gb = models.PositiveIntegerField(default=0)
    # A replica across nodes (issue 37): a worker runs llama.cpp's rpc-server behind stunnel (`rpc`),
    # the head a llama-server built with the RPC backend (`rpc_head`). A node may have either or both.
    rpc = models.BooleanField(
        "RPC worker", default=False, help_text="the agent runs rpc-server and stunnel: it can hold a share of a group"
    )
    rpc_head = models.BooleanField(
        "RPC head", default=False, help_text="the agent's llama-server has the RPC backend: it can lead a group"
    )
    disk_free_bytes = models.BigIntegerField(default=0)
    agent_version = models.CharField(max_length=50, blank=True)
    last_heartbeat = models.DateTimeField(null=True, blank=True)
    # Set by staff; a heartbeat never clears it.
    draining = models.BooleanField(default=False)
    # sha256 of the enrolment token; the token itself is shown once and never stored.
    token_hash = models.CharField(max_length=64, blank=True, db_index=True)
    # Where the node's engines answer, as enrolled (`manage.py node_token NAME --address HOST`):
    # a replica is routed to only at http://ADDRESS:PORT/v1, whatever its node reports.
    # Empty: loopback only (a node on the control plane's own host, `make run`, the tests).
    address = models.CharField(
        max_length=253,
        blank=True,
        help_text="the IP address or host name the gateway reaches this node's engines at; empty: 127.0.0.1 only",
    )
    # The key of its engines' secrets, made from token_hash and kept with it by save()
    # (contracts.credentials): the gateway reads this column and never token_hash, which
    # signs the node's orders (docs/fleet.md's grants).
    replica_key = models.CharField(max_length=64, blank=True, editable=False)
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]
        # Beyond changing a node: a token is the node's credential (docs/roles.md).
        permissions = [("issue_node_token", "Can make a node's enrolment token")]

    def __str__(self) -> str:
        return self.name

    def save(self, *args, **kwargs):
        self.replica_key = credentials.replica_key(self.token_hash)
        fields = kwargs.get("update_fields")
        if fields is not None and "token_hash" in fields:
            kwargs["update_fields"] = {*fields, "replica_key"}
        super().save(*args, **kwargs)

    @property
    def gpu_total(self) -> int:
        return len(self.gpus)

    @property
    def state(self) -> str:
        if self.draining:
            return self.State.DRAINING
        return self.State.READY if heard_from_lately(self.last_heartbeat) else self.State.NOT_READY


class Replica(models.Model):
    """One running copy of a catalog model on a node, or the attempt to have one.

    The model and profile are held by name, not by foreign key: a replica outlives
    its catalog entry long enough to be stopped (a deleted model's engines keep
    running until their node is told), and it must still say what it is while it
    does.
    """

    class State(models.TextChoices):
        PENDING = "pending", "pending"
        FETCHING = "fetching", "fetching"
        STARTING = "starting", "starting"
        READY = "ready", "ready"
        FAILED = "failed", "failed"
        STOPPING = "stopping", "stopping"

    model_name = models.CharField("model", max_length=200, db_index=True)
    profile_name = models.CharField("profile", max_length=100)
    node = models.ForeignKey(Node, null=True, blank=True, on_delete=models.SET_NULL, related_name="replicas")
    state = models.CharField(max_length=20, choices=State.choices, default=State.PENDING, db_index=True)
    endpoint = models.CharField(max_length=300, blank=True, help_text="the engine's OpenAI-compatible base URL")
    reason = models.TextField(blank=True, help_text="why it is pending or failed, in a sentence")
    since = models.DateTimeField(default=timezone.now, help_text="when it entered its state")
    # Failures in a row; the control plane's retry waits longer after each one.
    attempts = models.PositiveIntegerField(default=0)
    # What it was started with, copied from the catalog when placed: the books of
    # a running engine do not change when somebody edits its profile.
    source = models.CharField(max_length=500, blank=True)
    engine = models.CharField(max_length=20, blank=True)
    args = models.JSONField(default=list, blank=True)
    memory_gb = models.PositiveIntegerField(default=0)
    gpus = models.PositiveIntegerField(default=0)
    # Why placement added it: "fewest", "load", "a request woke it" (fleet.autoscale).
    # Why it is stopping is its `reason`, e.g. "idle 15 min" or "stopped to make room for M".
    cause = models.CharField("added for", max_length=200, blank=True)
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["model_name", "id"]

    def __str__(self) -> str:
        where = self.node.name if self.node_id else "nowhere yet"
        return f"{self.model_name} #{self.pk} on {where}"

    def enter(self, state: str, reason: str = "", endpoint: str | None = None) -> None:
        """Move to a state; `since` changes only when the state does."""
        if state != self.state:
            self.since = timezone.now()
        self.state = state
        self.reason = reason
        if endpoint is not None:
            self.endpoint = endpoint


class ReplicaShare(models.Model):
    """A worker's part of a replica that spans several nodes (issue 37): its layers, on its node.

    The replica's own node is the group's head, which runs the engine; each share's node runs
    llama.cpp's rpc-server behind its fenced transport at `port` (contracts/groups.py). The group is
    one replica: it is ready when the head is, and fails when any share fails or its node is lost.
    """

    class State(models.TextChoices):
        PENDING = "pending", "pending"
        FETCHING = "fetching", "fetching"
        STARTING = "starting", "starting"
        READY = "ready", "ready"
        FAILED = "failed", "failed"

    replica = models.ForeignKey(Replica, on_delete=models.CASCADE, related_name="shares")
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="replica_shares")
    share = models.FloatField(help_text="its part of the layers (--tensor-split), by its free memory when placed")
    memory_gb = models.PositiveIntegerField(default=0, help_text="what it holds of its node's memory")
    port = models.PositiveIntegerField(help_text="where its node's fenced transport listens (LLMGW_RPC_PORTS)")
    state = models.CharField(max_length=20, choices=State.choices, default=State.PENDING)
    reason = models.TextField(blank=True)
    since = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["replica", "id"]
        constraints = [
            models.UniqueConstraint(fields=["replica", "node"], name="replica_share_unique"),
            models.UniqueConstraint(fields=["node", "port"], name="replica_share_port_unique"),
        ]

    def __str__(self) -> str:
        return f"{self.replica_id} on {self.node}: {self.share:.0%}"


class Scale(models.Model):
    """How many replicas the autoscaler wants of a model now, between its fewest and most.

    The catalog says the bounds; this row is the control plane's own state, kept
    across passes: the count, when it last changed and why, and when the model was
    last asked for (the gateway's snapshots only live seconds).
    """

    model_name = models.CharField("model", max_length=200, unique=True)
    replicas = models.PositiveIntegerField(default=0)
    changed = models.DateTimeField(default=timezone.now, help_text="when the count last changed")
    why = models.CharField(max_length=300, blank=True, help_text="why the count last changed")
    # Unix time of the last request the gateway saw, or of the last wake.
    last_request = models.FloatField(default=0)
    # Unix time the load last needed every replica it has: the quiet period runs from here.
    busy_at = models.FloatField(default=0)

    class Meta:
        ordering = ["model_name"]
        verbose_name = "replica count"

    def __str__(self) -> str:
        return f"{self.model_name}: {self.replicas}"


class FetchQuerySet(models.QuerySet):
    def request(self, node: Node, source: str, user=None) -> Fetch:
        """Ask a node to fetch a source; the task is sent once the row is saved.

        Raises SourceError, before anything is saved or sent, for an address the
        node would refuse: staff get the sentence now, not a failed fetch later.
        """
        cache_parts(source)
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
            progress.clear_cancel(redis_client(), node.name, source)
            kwargs = signing.with_proof(node.token_hash, tasks.FETCH, node.name, [source])
            current_app.send_task(
                tasks.FETCH, args=[source], kwargs=kwargs, queue=tasks.node_queue(node.name), task_id=task_id
            )

        transaction.on_commit(send)
        return fetch

    def record(self, node: Node, report: tasks.FetchReport) -> Fetch | None:
        """A node's report of a finished, failed or cancelled fetch."""
        source = str(report.get("source") or "")[:1000]
        state = report.get("state")
        if not source or state not in tasks.FETCH_ENDINGS:
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
    """The control plane's record of a fetch: one row per node and source.

    Live progress is in Redis under the source's address; this is what remains
    when a fetch has finished or failed, reported by the node as a task on
    `control` (a node has no database), and what staff asked for and cancelled.
    """

    class State(models.TextChoices):
        REQUESTED = "requested", "requested"
        COMPLETE = "complete", "complete"
        FAILED = "failed", "failed"
        CANCELLED = "cancelled", "cancelled"

    node = models.ForeignKey(Node, related_name="fetches", on_delete=models.CASCADE)
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
        verbose_name_plural = "fetches"
        # Named from when fetches were the agent app's; renaming it would rebuild the table for nothing.
        constraints = [models.UniqueConstraint(fields=["node", "source"], name="agent_fetch_unique")]

    def __str__(self) -> str:
        return f"{self.source} on {self.node}"

    def cancel(self) -> bool:
        """Stop this fetch: revoked if it has not started, stopped between chunks if it has."""
        if self.state != self.State.REQUESTED:
            return False
        progress.request_cancel(redis_client(), self.node.name, self.source)
        if self.task_id:
            current_app.control.revoke(self.task_id)
        self.state = self.State.CANCELLED
        self.error = "cancelled by staff"
        self.finished_at = timezone.now()
        self.save(update_fields=["state", "error", "finished_at"])
        return True


class MeasuredMemory(models.Model):
    """The most memory a model's profile has been measured to use, and its last bench result.

    Kept per (model, profile) and for what it ran as (source, engine, arguments): another
    version or a new --ctx-size starts it again from nothing. Written by heartbeats only
    when a replica's figure rises above it (fleet.memory), and by `manage.py bench_replica`.
    """

    model_name = models.CharField("model", max_length=200)
    profile_name = models.CharField("profile", max_length=100)
    source = models.CharField(max_length=500, blank=True)
    engine = models.CharField(max_length=20, blank=True)
    args = models.JSONField(default=list, blank=True)
    # PSS where the node could read it (mapped weights shared between replicas count once), else RSS.
    host_bytes = models.BigIntegerField("host memory", default=0)
    rss_bytes = models.BigIntegerField("RSS", default=0)
    gpu_bytes = models.BigIntegerField("GPU memory", default=0)
    replica_id = models.PositiveIntegerField("replica", null=True, blank=True)
    node_name = models.CharField("node", max_length=100, blank=True)
    measured_at = models.DateTimeField(null=True, blank=True)
    # `manage.py bench_replica`: per concurrency, tokens per second, time to first token and memory.
    bench = models.JSONField(default=dict, blank=True)
    bench_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["model_name", "profile_name"]
        verbose_name = "measured memory"
        verbose_name_plural = "measured memory"
        constraints = [models.UniqueConstraint(fields=["model_name", "profile_name"], name="measured_memory_unique")]

    def __str__(self) -> str:
        return f"{self.model_name}/{self.profile_name}"

    def runs_as(self) -> dict:
        return {"source": self.source, "engine": self.engine, "args": list(self.args or [])}

    @property
    def host_gb(self) -> int:
        """Whole GB, rounded up: what placement books for the profile."""
        return -(-self.host_bytes // (1 << 30)) if self.host_bytes else 0
