"""Who may use the API: staff users' tokens, kept only as their hashes and good for a while."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone


class ApiToken(models.Model):
    """A staff user's API token (`Authorization: Token …`): shown once when made, stored as its sha256.

    A copy of the table (a backup, a replica, a role that reads it) lets nobody in, and a
    token left in a script stops working at `expires` (LLMGW_API_TOKEN_DAYS after it was made).
    """

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    key_hash = models.CharField(max_length=64, unique=True, editable=False)
    # Its first characters: enough for staff to tell their tokens apart, nothing to sign in with.
    prefix = models.CharField(max_length=8, editable=False)
    created = models.DateTimeField(default=timezone.now, editable=False)
    expires = models.DateTimeField(editable=False)
    last_used = models.DateTimeField(null=True, blank=True, editable=False)

    class Meta:
        ordering = ["-created"]
        verbose_name = "API token"

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.user})"

    @property
    def expired(self) -> bool:
        return self.expires <= timezone.now()
