"""The catalog: the models llmgw serves, and the profiles that say where and how they run."""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.core.validators import MaxLengthValidator
from django.db import models
from django.utils import timezone

from contracts.engines import slot_args

from . import defaults
from .rules import (
    MAX_DESCRIPTION,
    alias_problem,
    args_problem,
    clash,
    declared_source_problem,
    name_problem,
    nodes_problem,
    routing_problem,
    scaling_problem,
    selector_problem,
    source_problem,
    target_load_problem,
)


class Engine(models.TextChoices):
    LLAMACPP = "llamacpp", "llama.cpp"
    VLLM = "vllm", "vLLM"


class RoutingProfile(models.TextChoices):
    """How the gateway chooses among a model's replicas (gateway/prefix.py)."""

    CHAT = "chat", "chat: by the conversation's prefix, bounded by load"
    LOAD = "load", "load: the fewest requests in flight"


class Kind(models.TextChoices):
    """What a model answers: the gateway sends each address only to models of its kind."""

    CHAT = "chat", "chat"
    EMBEDDING = "embedding", "embedding"
    RERANK = "rerank", "rerank"


class Model(models.Model):
    name = models.CharField(max_length=200, unique=True, help_text="What clients ask for in the gateway.")
    description = models.TextField(
        blank=True, max_length=MAX_DESCRIPTION, validators=[MaxLengthValidator(MAX_DESCRIPTION)]
    )
    aliases = models.JSONField(default=list, blank=True, help_text="Other names clients may use: a list of strings.")
    # A URL ending in "/" names a version of several files; without it, one file.
    source = models.CharField(max_length=1000)
    context_length = models.PositiveIntegerField(help_text="The most tokens one request may use.")
    max_output = models.PositiveIntegerField(
        "output limit", default=0, help_text="The most tokens one reply may have; 0 for no limit."
    )
    kind = models.CharField(
        max_length=20,
        choices=Kind.choices,
        default=Kind.CHAT,
        help_text="chat answers /v1/chat/completions and /v1/completions; embedding /v1/embeddings; "
        "rerank /v1/rerank. The engine is started for it.",
    )
    routing_profile = models.CharField(
        "routing",
        max_length=50,
        choices=RoutingProfile.choices,
        default=RoutingProfile.CHAT,
        help_text="chat sends a conversation's every turn to the replica that has its start cached, unless that "
        "replica is busier than its share; load sends each request to the replica with the fewest in flight. "
        "Embedding and rerank models are routed by load either way.",
    )
    scaling_min = models.PositiveIntegerField("fewest replicas", default=defaults.SCALING_MIN)
    scaling_max = models.PositiveIntegerField("most replicas", default=defaults.SCALING_MAX)
    # Between fewest and most the count follows the load the gateway sees (fleet.autoscale).
    target_load = models.PositiveIntegerField(
        "target load",
        default=defaults.TARGET_LOAD,
        help_text="Requests in flight per ready replica before another is added: a llama.cpp model's parallel "
        "slots (the serve page sets it so), since one replica answers that many at once.",
    )
    quiet_s = models.PositiveIntegerField(
        "quiet period (s)",
        default=defaults.QUIET_S,
        help_text="How long the load must stay below what the replicas serve before one of them is stopped.",
    )
    idle_s = models.PositiveIntegerField(
        "idle time (s)",
        default=defaults.IDLE_S,
        help_text="With fewest 0: how long without a request before the last replica stops.",
    )
    priority = models.PositiveIntegerField(
        default=defaults.PRIORITY,
        help_text="When a model waking fits on no node, idle replicas of lower priority are stopped first to "
        "make room, and never one of a model of higher priority than the one waking.",
    )
    # Prices per million tokens, in one currency for the whole catalog (LLMGW_PRICE_CURRENCY); blank is free.
    price_input = models.DecimalField(
        "price per million input tokens", max_digits=12, decimal_places=6, null=True, blank=True
    )
    price_cached_input = models.DecimalField(
        "price per million cached input tokens",
        max_digits=12,
        decimal_places=6,
        null=True,
        blank=True,
        help_text="Prompt tokens the engine had cached; blank to charge them as input.",
    )
    price_output = models.DecimalField(
        "price per million output tokens", max_digits=12, decimal_places=6, null=True, blank=True
    )
    # A username, or "configuration" for a declared model: who to ask about it.
    added_by = models.CharField(max_length=150, blank=True)
    added_at = models.DateTimeField(default=timezone.now)
    # Read from LLMGW_CATALOG; read-only everywhere else, so the file stays the one record of it.
    declared = models.BooleanField(default=False, editable=False)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def problems(self) -> dict[str, str]:
        """What the catalog's rules find wrong with this model on its own, by field; no other model is asked.

        The admin and the API (through clean()) and the configuration file (catalog.config) all ask this.
        """
        errors = {}
        if problem := name_problem(self.name):
            errors["name"] = problem
        if problem := alias_problem(self.aliases, self.name):
            errors["aliases"] = problem
        if problem := scaling_problem(self.scaling_min, self.scaling_max):
            errors["scaling_max"] = problem
        if problem := target_load_problem(self.target_load):
            errors["target_load"] = problem
        if problem := routing_problem(self.routing_profile, RoutingProfile.choices):
            errors["routing_profile"] = problem
        # A declared model's source is written by whoever runs the machine, and may be any address.
        if problem := (declared_source_problem if self.declared else source_problem)(self.source):
            errors["source"] = problem
        return errors

    def clean(self) -> None:
        errors = self.problems()
        others = Model.objects.exclude(pk=self.pk).values_list("name", "aliases", "declared")
        if not errors and (problem := clash(self.name, self.aliases, others)):
            errors[problem[0]] = problem[1]
        if errors:
            raise ValidationError(errors)


class Profile(models.Model):
    model = models.ForeignKey(Model, related_name="profiles", on_delete=models.CASCADE)
    # Named for the hardware rather than the model ("cpu", "gpu"): a profile is about where a model runs.
    name = models.CharField(max_length=100)
    engine = models.CharField(max_length=20, choices=Engine.choices)
    args = models.JSONField(default=list, blank=True, help_text="Extra engine arguments: a list of strings.")
    weight = models.PositiveIntegerField(default=defaults.WEIGHT)
    priority = models.PositiveIntegerField(default=defaults.PRIORITY)
    min_memory_gb = models.PositiveIntegerField(
        "min memory (GB)", default=defaults.MIN_MEMORY_GB, help_text="Host RAM a node must have."
    )
    node_selector = models.JSONField(
        default=dict, blank=True, help_text="Labels a node must carry, as {key: value}; empty for any node."
    )
    nodes = models.PositiveIntegerField(
        default=1,
        help_text="How many nodes one replica may span when no single node holds it: llama.cpp's RPC backend "
        "(a GGUF model) or vLLM over Ray. 1 runs each replica on one node.",
    )
    gpus = models.PositiveIntegerField("GPUs", default=0, help_text="GPUs a replica needs; 0 runs on the CPU.")
    parallel = models.PositiveIntegerField(
        "parallel slots",
        default=1,
        help_text="Requests one replica answers at once (llama.cpp's --parallel); they share the context pool "
        "(--ctx-size), each getting its share. vLLM schedules its own and ignores this.",
    )

    class Meta:
        ordering = ["model", "priority", "name"]
        constraints = [models.UniqueConstraint(fields=["model", "name"], name="catalog_profile_unique")]

    def __str__(self) -> str:
        return f"{self.model.name}/{self.name}"

    def engine_args(self) -> list[str]:
        """What its engine is started with: its args, and `--parallel N` for an engine with slots."""
        return [*self.args, *slot_args(self.engine, self.parallel, self.args)]

    def problems(self) -> dict[str, str]:
        """What the catalog's rules find wrong with this profile, by field (see Model.problems)."""
        errors = {}
        if self.parallel < 1:
            errors["parallel"] = "a replica needs at least one slot"
        if problem := nodes_problem(self.nodes, self.engine):
            errors["nodes"] = problem
        if problem := args_problem(self.args, self.engine):
            errors["args"] = problem
        if problem := selector_problem(self.node_selector):
            errors["node_selector"] = problem
        return errors

    def clean(self) -> None:
        if errors := self.problems():
            raise ValidationError(errors)
