"""The serve form: one Django form for the serve page and for `POST /api/serve/`.

The rules and their sentences are `build_model`'s (pure, from the seed); this form
only carries the fields, shows every sentence beside its field at once, and saves.
"""

from __future__ import annotations

from django import forms

from catalog.models import Engine, Kind, Model

from . import services
from .planning import ServeError, ServePlan, build_model, slot_warning


class TextField(forms.CharField):
    """Text as typed; from the API also a number, or a list of strings (aliases, as the catalog API writes them)."""

    def to_python(self, value):
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            value = ",".join(value)
        elif value is not None and (isinstance(value, bool) or not isinstance(value, str | int)):
            raise forms.ValidationError("%(name)s must be written as text or a number", params={"name": self.name})
        return super().to_python(value)


def text(label: str, help_text: str = "", wide: bool = False) -> TextField:
    attrs = {"class": "wide"} if wide else {}
    return TextField(label=label, help_text=help_text, required=False, widget=forms.TextInput(attrs=attrs))


class ServeForm(forms.Form):
    name = text("Name", "What clients ask for.")
    description = text("Description", wide=True)
    aliases = text("Aliases", "Other names clients may use, comma-separated.")
    source = text("Source", "On the byte listener; a trailing / names the whole version.", wide=True)
    kind = TextField(
        label="Kind",
        required=False,
        help_text="What it answers: chat, embeddings (/v1/embeddings) or reranking (/v1/rerank).",
        widget=forms.Select(choices=[(k.value, k.label) for k in Kind]),
    )
    context_length = text("Context length", "The most tokens one request may use.")
    max_output = text("Output limit", "The most tokens one reply may have; blank for no limit.")
    replicas = text("Replicas", "How many copies to keep running.")
    engine = TextField(
        label="Engine",
        required=False,
        widget=forms.Select(choices=(("", "—"), *((e.value, e.label) for e in Engine))),
    )
    profile = text("Profile", "Named for the hardware it runs on.")
    parallel = text(
        "Parallel slots",
        "Requests one replica answers at once (llama.cpp's --parallel); the model's target load follows it.",
    )
    ctx_size = text(
        "Engine context pool",
        "llama.cpp's --ctx-size, shared by its slots, each getting its share; blank for slots × context length.",
    )
    min_memory_gb = text(
        "Min memory (GB)",
        "From the weights' header: weights + KV cache at this pool + overhead; size × 1.5 + 2 where no header was read.",
    )
    nodes = text(
        "Nodes",
        "How many nodes one replica may span when no single node holds it (llama.cpp's RPC backend, vLLM over Ray); "
        "1 for one node. Offered above 1 when the largest node is too small, with the estimate per node.",
    )
    selector_key = text("Node selector key", "A label nodes must carry, e.g. size.")
    selector_value = text("Node selector value", "Its value, e.g. large.")

    FIELDSETS = (
        ("The catalog entry", ("name", "description", "aliases", "source", "kind")),
        ("What clients get", ("context_length", "max_output", "replicas")),
        (
            "Where and how it runs",
            (
                "engine",
                "profile",
                "parallel",
                "ctx_size",
                "min_memory_gb",
                "nodes",
                "selector_key",
                "selector_value",
            ),
        ),
    )

    def __init__(self, *args, byte_base: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.byte_base = byte_base
        # Said once the entry is saved, not a refusal (planning.slot_warning).
        self.warning = ""
        for name, field in self.fields.items():
            field.name = name

    @classmethod
    def for_plan(cls, plan: ServePlan, byte_base: str) -> ServeForm:
        """The form as the serve page first shows it: what the mirror already knows, filled in."""
        initial = {
            "name": plan.model,
            "source": plan.source,
            "kind": plan.kind,
            "engine": plan.engine,
            "profile": plan.profile,
            "parallel": str(plan.parallel or ""),
            "min_memory_gb": str(plan.min_memory_gb or ""),
            "nodes": str(plan.nodes),
        }
        return cls(initial=initial, byte_base=byte_base)

    def fieldsets(self) -> list[tuple[str, list[forms.BoundField]]]:
        return [(title, [self[name] for name in names]) for title, names in self.FIELDSETS]

    def clean(self):
        cleaned = super().clean()
        if not self.errors:
            try:
                self.entry, self.entry_profile = build_model(cleaned, self.byte_base)
            except ServeError as refused:
                self.add_serve_error(refused)
            else:
                self.warning = slot_warning(self.entry, self.entry_profile)
        return cleaned

    def add_serve_error(self, refused: ServeError) -> None:
        for field, sentence in refused.errors:
            self.add_error(field if field in self.fields else None, sentence)

    def save(self, added_by: str) -> Model | None:
        """The new catalog entry, or None with every sentence on the form."""
        if not self.is_valid():
            return None
        try:
            return services.add_model(self.entry, [self.entry_profile], added_by)
        except ServeError as refused:
            self.add_serve_error(refused)
            return None

    def first_error(self) -> tuple[str, str]:
        """(field, sentence) of the first problem, in the order of the form."""
        for name in [*self.fields, "__all__"]:
            if name in self.errors:
                return name, self.errors[name][0]
        raise ValueError("the form has no errors")
