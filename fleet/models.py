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
    engines = models.JSONField(default=list, blank=True, help_text="engines the agent found installed")
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
