"""Who may use llmgw: staff users' API tokens (kept only as their hashes, good for a while), and the
organisation's teams, whose members share the team's models and budgets (docs/teams.md)."""

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


class Team(models.Model):
    """People who share models and budgets: every key of the team counts against the team's limits too.

    What a team's key may do is the tighter of the key's own limits and the team's (gateway/limits.py).
    """

    name = models.CharField(max_length=100, unique=True)
    model_names = models.JSONField(
        "models",
        default=list,
        blank=True,
        help_text='Catalog model names the team\'s keys may use, as a list like ["llama-3"]; empty for every model.',
    )
    # Budgets shared by all the team's keys, each blank for none; a month is a calendar month in
    # LLMGW_BUDGET_TIME_ZONE.
    requests_per_minute = models.PositiveIntegerField(null=True, blank=True, help_text="Blank for no limit.")
    tokens_per_minute = models.PositiveBigIntegerField(null=True, blank=True, help_text="Blank for no limit.")
    tokens_per_day = models.PositiveBigIntegerField(null=True, blank=True, help_text="Blank for no limit.")
    tokens_per_month = models.PositiveBigIntegerField(null=True, blank=True, help_text="Blank for no limit.")
    spend_per_month = models.DecimalField(
        max_digits=14,
        decimal_places=4,
        null=True,
        blank=True,
        help_text="In the catalog's prices' currency; blank for no limit.",
    )
    created = models.DateTimeField(default=timezone.now, editable=False)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class TeamMember(models.Model):
    """A person in a team: a member makes keys for the team; a team admin also sees the team's keys and usage."""

    class Role(models.TextChoices):
        MEMBER = "member", "member"
        ADMIN = "admin", "team admin"

    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="members")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="team_memberships")
    role = models.CharField(max_length=10, choices=Role.choices, default=Role.MEMBER)
    # Set by the identity provider's groups at sign-in (and removed by it); a membership made by hand is kept.
    from_provider = models.BooleanField(default=False, editable=False)
    added = models.DateTimeField(default=timezone.now, editable=False)

    class Meta:
        ordering = ["team", "user"]
        constraints = [models.UniqueConstraint(fields=["team", "user"], name="accounts_teammember_unique")]

    def __str__(self) -> str:
        return f"{self.user} in {self.team} ({self.role})"


class ProviderAccount(models.Model):
    """Which person at the identity provider a user is: the provider's subject, never a name or an address.

    A user is found again by this alone, so a local account (the break-glass admin) is never
    taken over by someone whose provider says they have its username or email.
    """

    user = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="provider_account")
    issuer = models.CharField(max_length=255, editable=False)
    subject = models.CharField(max_length=255, editable=False)
    created = models.DateTimeField(default=timezone.now, editable=False)
    last_sign_in = models.DateTimeField(null=True, blank=True, editable=False)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["issuer", "subject"], name="accounts_provideraccount_unique"),
        ]

    def __str__(self) -> str:
        return f"{self.user} ({self.subject} at {self.issuer})"
