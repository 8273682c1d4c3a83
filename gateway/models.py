"""API keys for the gateway's clients, and what each key has used."""

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import models

from accounts.models import Team

from .limits import LIMIT_FIELDS  # a key's limits are named once, in the limiter

# The gateway holds every key's models in memory: a list without a bound would cost every request.
MAX_MODELS = 1000


class ApiKey(models.Model):
    name = models.CharField(max_length=100, unique=True, help_text="Who or what uses this key.")
    # The key's first characters, so staff can tell keys apart; the rest is never stored.
    prefix = models.CharField(max_length=16, editable=False)
    # sha256 of the whole key. Keys are 256 random bits, so a plain hash is as good as a slow one.
    key_hash = models.CharField(max_length=64, unique=True, editable=False)
    model_names = models.JSONField(
        "models",
        default=list,
        blank=True,
        help_text='Catalog model names this key may use, as a list like ["llama-3"]; empty for every model.',
    )
    active = models.BooleanField(default=True, help_text="Clear to refuse this key without losing its usage.")
    # Limits, each blank (or 0) for none; enforced across every admin server through Redis (gateway/limits/).
    requests_per_minute = models.PositiveIntegerField(null=True, blank=True, help_text="Blank for no limit.")
    tokens_per_minute = models.PositiveBigIntegerField(null=True, blank=True, help_text="Blank for no limit.")
    tokens_per_day = models.PositiveBigIntegerField(null=True, blank=True, help_text="Blank for no limit.")
    tokens_per_month = models.PositiveBigIntegerField(null=True, blank=True, help_text="Blank for no limit.")
    max_in_flight = models.PositiveIntegerField(
        "requests in flight", null=True, blank=True, help_text="Requests answered at once; blank for no limit."
    )
    # A team's key counts against the team's budgets as well as its own; a person's key is theirs to see and
    # revoke on /me/. A team with keys is not deleted (PROTECT): deactivate the keys first.
    team = models.ForeignKey(Team, null=True, blank=True, on_delete=models.PROTECT, related_name="keys")
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT, related_name="api_keys"
    )
    expires = models.DateTimeField(null=True, blank=True, help_text="Blank for a key that does not expire.")
    created = models.DateTimeField(auto_now_add=True)
    created_by = models.CharField(max_length=150, blank=True)
    last_used = models.DateTimeField(null=True, blank=True, editable=False)

    class Meta:
        ordering = ["name"]
        verbose_name = "API key"
        # Beyond changing a key: a new secret is a new credential (docs/roles.md).
        permissions = [("rotate_api_key", "Can make a new secret for an API key")]

    def __str__(self) -> str:
        return self.name

    def limits(self) -> tuple[int, int, int, int, int]:
        """The limits in LIMIT_FIELDS' order, 0 for none."""
        return tuple(getattr(self, name) or 0 for name in LIMIT_FIELDS)

    def clean(self) -> None:
        if not isinstance(self.model_names, list) or not all(
            isinstance(m, str) and m.strip() for m in self.model_names
        ):
            raise ValidationError(
                {"model_names": 'Write the models as a list of names, like ["llama-3"], or [] for all.'}
            )
        if len(self.model_names) > MAX_MODELS or any(len(m) > 200 for m in self.model_names):
            raise ValidationError({"model_names": f"A key may name at most {MAX_MODELS} models of 200 characters."})


class Usage(models.Model):
    """Requests and tokens per key, model and day, as the engines counted them."""

    key = models.ForeignKey(ApiKey, related_name="usage", on_delete=models.CASCADE)
    model_name = models.CharField("model", max_length=200)
    day = models.DateField()
    requests = models.PositiveBigIntegerField(default=0)
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)
    # Of the prompt tokens, those the engine had cached (priced apart: catalog Model.price_cached_input).
    cached_tokens = models.PositiveBigIntegerField(default=0)
    # What the tokens cost at the model's prices when they were used, in the prices' currency.
    spend = models.DecimalField(max_digits=20, decimal_places=8, default=0)

    class Meta:
        ordering = ["-day", "key", "model_name"]
        verbose_name_plural = "usage"
        constraints = [models.UniqueConstraint(fields=["key", "model_name", "day"], name="gateway_usage_unique")]

    def __str__(self) -> str:
        return f"{self.key} / {self.model_name} / {self.day}"

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class TableChange(models.Model):
    """A row the gateway routes by was added, changed or deleted.

    Written by database triggers (migration 0002), not by Django: every way a
    row can change, a queryset's update() and a raw statement included, leaves
    a mark, and a gateway re-reads only the rows marked since its last look.
    Rows older than a few minutes are deleted by the gateways themselves.
    """

    table = models.CharField(max_length=10)  # "key", "model", "profile" or "replica"
    row_id = models.BigIntegerField()
    at = models.DateTimeField(db_index=True, help_text="The database's clock when the row changed.")

    class Meta:
        ordering = ["id"]

    def __str__(self) -> str:
        return f"{self.table} {self.row_id} at {self.at}"


class UsageBatch(models.Model):
    """A batch of usage a gateway has written (gateway/usage.py): written in the same transaction as its counts,
    so a batch tried again after its transaction committed, by any gateway, is not counted twice."""

    id = models.CharField(max_length=32, primary_key=True)
    written = models.DateTimeField(auto_now_add=True, db_index=True)

    def __str__(self) -> str:
        return self.id
