"""Models declared in the configuration file (LLMGW_CATALOG), read and applied.

The file is the one record of a declared model: the admin and the API show it
read-only, and loading the file again makes the catalog match it, removing a
declared model the file no longer names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml
from django.core.exceptions import ValidationError
from django.db import transaction

from contracts.engines import SPECS

from . import defaults
from .models import Engine, Kind, Model, Profile
from .rules import name_problem

MODEL_KEYS = {
    "name",
    "description",
    "aliases",
    "source",
    "context_length",
    "max_output",
    "kind",
    "routing_profile",
    "scaling",
    "profiles",
}
SCALING_KEYS = {"min", "max", "target_load", "quiet_s", "idle_s", "priority"}
PROFILE_KEYS = {
    "name",
    "engine",
    "args",
    "weight",
    "priority",
    "min_memory_gb",
    "node_selector",
    "gpus",
    "parallel",
    "nodes",
}
# Where in an entry of the file a model's field is written, when it is not under its own name.
FILE_KEYS = {
    "scaling_min": "scaling.min",
    "scaling_max": "scaling",  # the rule is about both bounds
    "target_load": "scaling",
    "quiet_s": "scaling.quiet_s",
    "idle_s": "scaling.idle_s",
    "priority": "scaling.priority",
}
# Fields the file does not write: set by loading it, or the profile's model, made when it is saved.
NOT_FROM_THE_FILE = ["added_by", "added_at", "declared", "model"]


class CatalogFileError(Exception):
    """The configuration file is not a valid catalog; the message names the entry and the field."""


@dataclass
class LoadReport:
    added: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    taken_over: list[str] = field(default_factory=list)

    def summary(self) -> str:
        parts = [f"{len(self.added)} added", f"{len(self.updated)} updated", f"{len(self.removed)} removed"]
        if self.taken_over:
            parts.append(f"{', '.join(self.taken_over)} now declared in configuration")
        return ", ".join(parts)


def read(path: Path) -> list[dict]:
    """The declared models in this file, checked; raises CatalogFileError with a sentence."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise CatalogFileError(f"the catalog file {path} cannot be read: {error.strerror or error}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        # Where the broken construct began, which is where somebody has to look;
        # the problem mark of an unclosed bracket is the end of the file.
        where = getattr(error, "context_mark", None) or getattr(error, "problem_mark", None)
        line = f" at line {where.line + 1}" if where else ""
        raise CatalogFileError(f"the catalog file {path} is not valid YAML{line}") from None
    if data is None:
        return []
    if not isinstance(data, dict) or not isinstance(data.get("models", []), list):
        raise CatalogFileError(f"the catalog file {path} must be a mapping with a list under models:")
    entries = [_model(path, i, entry) for i, entry in enumerate(data.get("models") or [])]
    _check_names_unique(path, entries)
    return entries


def _whole(where: str, name: str, value, default: int | None = None, minimum: int = 0) -> int:
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise CatalogFileError(f"{where}: {name} must be a whole number of at least {minimum}")
    return value


def _model(path, index: int, entry) -> dict:
    where = f"{path}: models[{index}]"
    if not isinstance(entry, dict):
        raise CatalogFileError(f"{where} must be a mapping of fields")
    name = entry.get("name")
    if not isinstance(name, str) or (problem := name_problem(name)):
        raise CatalogFileError(f"{where}: name: {problem if isinstance(name, str) else 'a model needs a name'}")
    where = f"{path}: model {name}"
    if unknown := sorted(set(entry) - MODEL_KEYS):
        raise CatalogFileError(
            f"{where}: {unknown[0]} is not a field of a model (fields: {', '.join(sorted(MODEL_KEYS))})"
        )
    scaling = entry.get("scaling") or {}
    if not isinstance(scaling, dict) or set(scaling) - SCALING_KEYS:
        raise CatalogFileError(
            f"{where}: scaling must be written {{min: N, max: N}}, with optionally "
            "target_load, quiet_s, idle_s and priority"
        )
    scaling_min = _whole(where, "scaling.min", scaling.get("min"), defaults.SCALING_MIN)
    scaling_max = _whole(where, "scaling.max", scaling.get("max"), scaling_min)
    profiles = entry.get("profiles")
    if not isinstance(profiles, list) or not profiles:
        raise CatalogFileError(f"{where}: profiles must list at least one profile (engine, args, ...)")
    read_profiles = [_profile(where, i, p) for i, p in enumerate(profiles)]
    # Unless it says: what one replica answers at once, its first profile's slots.
    target_load = _whole(where, "scaling.target_load", scaling.get("target_load"), read_profiles[0]["parallel"])
    model = {
        "name": name,
        "description": str(entry.get("description") or ""),
        "aliases": entry.get("aliases") or [],
        "source": entry.get("source"),
        "context_length": _whole(where, "context_length", entry.get("context_length"), minimum=1),
        "max_output": _whole(where, "max_output", entry.get("max_output"), 0),
        "kind": _kind(where, entry.get("kind")),
        "routing_profile": str(entry.get("routing_profile") or "chat"),
        "scaling_min": scaling_min,
        "scaling_max": scaling_max,
        "target_load": target_load,
        "quiet_s": _whole(where, "scaling.quiet_s", scaling.get("quiet_s"), defaults.QUIET_S),
        "idle_s": _whole(where, "scaling.idle_s", scaling.get("idle_s"), defaults.IDLE_S),
        "priority": _whole(where, "scaling.priority", scaling.get("priority"), defaults.PRIORITY),
    }
    # The rules the admin and the API ask (Model.problems, then the fields' own), before the profiles'.
    _refuse(where, Model(declared=True, **model), FILE_KEYS)
    model["profiles"] = read_profiles
    profile_names = [p["name"] for p in model["profiles"]]
    if len(set(profile_names)) != len(profile_names):
        raise CatalogFileError(f"{where}: two profiles have the same name")
    return model


def _kind(where: str, value) -> str:
    if value is None:
        return Kind.CHAT.value
    if value not in Kind.values:
        raise CatalogFileError(f"{where}: kind must be one of {', '.join(Kind.values)}, not {value!r}")
    return value


def _profile(model_where: str, index: int, entry) -> dict:
    where = f"{model_where}: profiles[{index}]"
    if not isinstance(entry, dict):
        raise CatalogFileError(f"{where} must be a mapping of fields")
    if unknown := sorted(set(entry) - PROFILE_KEYS):
        raise CatalogFileError(
            f"{where}: {unknown[0]} is not a field of a profile (fields: {', '.join(sorted(PROFILE_KEYS))})"
        )
    engine = entry.get("engine")
    if engine not in Engine.values:
        raise CatalogFileError(f"{where}: engine must be llamacpp or vllm")
    name = entry.get("name") or engine
    if not isinstance(name, str) or not name:
        raise CatalogFileError(f"{where}: name must be text")
    args = entry.get("args") or []
    if isinstance(args, list):
        # YAML reads `--ctx-size, 8192` as a string and a number; the engine gets strings.
        args = [str(a) if isinstance(a, int | float) and not isinstance(a, bool) else a for a in args]
    selector = entry.get("node_selector") or {}
    if isinstance(selector, dict):
        selector = {
            k: str(v) if isinstance(v, int | float) and not isinstance(v, bool) else v for k, v in selector.items()
        }
    profile = {
        "name": name,
        "engine": engine,
        "args": args,
        "weight": _whole(where, "weight", entry.get("weight"), defaults.WEIGHT),
        "priority": _whole(where, "priority", entry.get("priority"), defaults.PRIORITY),
        "min_memory_gb": _whole(where, "min_memory_gb", entry.get("min_memory_gb"), defaults.MIN_MEMORY_GB),
        "node_selector": selector,
        "gpus": _whole(where, "gpus", entry.get("gpus"), SPECS[engine].default_gpus),
        "parallel": _whole(where, "parallel", entry.get("parallel"), 1, minimum=1),
        "nodes": _whole(where, "nodes", entry.get("nodes"), 1, minimum=1),
    }
    _refuse(where, Profile(**profile), {})
    return profile


def _refuse(where: str, instance: Model | Profile, keys: dict[str, str]) -> None:
    """Raise CatalogFileError with the first sentence the admin and the API would say of this instance.

    The catalog's rules first (`problems()`, what `clean()` asks), then the fields' own
    (lengths, choices), as the admin's form runs them; what needs the database (a name
    taken by another model) is asked when the file is applied, by `full_clean()`.
    """
    errors = instance.problems()
    if not errors:
        try:
            instance.clean_fields(exclude=NOT_FROM_THE_FILE)
        except ValidationError as error:
            errors = {field: " ".join(messages) for field, messages in error.message_dict.items()}
    for field_name, sentence in errors.items():
        raise CatalogFileError(f"{where}: {keys.get(field_name, field_name)}: {sentence}")


def _full_clean(instance: Model | Profile, where: str) -> None:
    """The whole of the admin's validation, database included, as a CatalogFileError."""
    try:
        instance.full_clean()
    except ValidationError as error:
        field_name, messages = next(iter(error.message_dict.items()))
        raise CatalogFileError(f"{where}: {FILE_KEYS.get(field_name, field_name)}: {' '.join(messages)}") from None


def _check_names_unique(path, entries: list[dict]) -> None:
    owner: dict[str, str] = {}
    for entry in entries:
        for name in [entry["name"], *entry["aliases"]]:
            if name in owner:
                raise CatalogFileError(
                    f"{path}: model {entry['name']}: {name} is already a name or alias of {owner[name]} in this file"
                )
            owner[name] = entry["name"]


@transaction.atomic
def apply(entries: list[dict]) -> LoadReport:
    """Make the declared models in the catalog match these entries."""
    report = LoadReport()
    declared_names = {e["name"] for e in entries}
    # A model added in the admin keeps its name and aliases: the file cannot quietly take one
    # from it, because clients already use it for that model. Model.full_clean says so, below.
    for gone in Model.objects.filter(declared=True).exclude(name__in=declared_names):
        report.removed.append(gone.name)
        gone.delete()
    for entry in entries:
        fields = {k: v for k, v in entry.items() if k not in {"name", "profiles"}}
        model = Model.objects.filter(name=entry["name"]).first()
        if model is None:
            model = Model.objects.create(name=entry["name"], declared=True, added_by="configuration", **fields)
            report.added.append(model.name)
        else:
            if not model.declared:
                report.taken_over.append(model.name)
            for key, value in fields.items():
                setattr(model, key, value)
            model.declared = True
            model.save()
            model.profiles.all().delete()
            report.updated.append(model.name)
        profiles = [Profile(model=model, **p) for p in entry["profiles"]]
        for profile in profiles:
            _full_clean(profile, f"model {model.name}: profile {profile.name}")
        for profile in profiles:
            profile.save()  # each saved, not bulk_create: the audit log hears of it
    # Each model again as the admin checks it (Model.full_clean), against the catalog as it now
    # is: a clash with another model is seen whichever order the file lists them in.
    for model in Model.objects.filter(declared=True, name__in=declared_names):
        _full_clean(model, f"model {model.name}")
    return report


def load(path: Path) -> LoadReport:
    return apply(read(path))
