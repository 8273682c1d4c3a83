"""The fleet: the nodes that run replicas, as their agents report them."""

import re
from datetime import timedelta

from django.conf import settings
from django.db import models
from django.utils import timezone

NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def node_name_problem(name: str) -> str | None:
    """Why this cannot be a node's name, or None.

    The name becomes the agent's Celery queue (node.NAME) and is typed on the
    agent's command line, so it is kept to characters that survive both.
    """
    if not NODE_NAME.fullmatch(name):
        return (
            f"{name!r} is not a node name: use up to 100 letters, digits, dots, dashes and underscores, "
            "starting with a letter or digit"
        )
    return None


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
    disk_free_bytes = models.BigIntegerField(default=0)
    agent_version = models.CharField(max_length=50, blank=True)
    last_heartbeat = models.DateTimeField(null=True, blank=True)
    # Set by staff; a heartbeat never clears it.
    draining = models.BooleanField(default=False)
    # sha256 of the enrolment token; the token itself is shown once and never stored.
    token_hash = models.CharField(max_length=64, blank=True, db_index=True)
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def gpu_total(self) -> int:
        return len(self.gpus)

    @property
    def state(self) -> str:
        if self.draining:
            return self.State.DRAINING
        if self.last_heartbeat is None:
            return self.State.NOT_READY
        missed_after = timedelta(seconds=settings.HEARTBEAT_S * settings.HEARTBEATS_MISSED)
        if timezone.now() - self.last_heartbeat > missed_after:
            return self.State.NOT_READY
        return self.State.READY


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
