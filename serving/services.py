"""The serve flow's reads and its one write: the facts a plan is made from, and the new catalog entry."""

from __future__ import annotations

from pathlib import Path

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction

from catalog.models import Kind, Model, Profile
from fleet.models import Node
from mirror.headers import read_version
from mirror.models import MirrorVersion
from mirror.readiness import not_ready_on_disk

from . import memory
from .planning import CatalogFacts, FileFacts, NodeFacts, ServeError, ServePlan, plan_serve


def catalog_facts() -> CatalogFacts:
    declared, taken = set(), set()
    for name, aliases, is_declared in Model.objects.values_list("name", "aliases", "declared"):
        taken.add(name)
        taken.update(aliases or [])
        if is_declared:
            declared.add(name)
    return CatalogFacts(declared=frozenset(declared), taken=frozenset(taken))


def fleet_facts() -> list[NodeFacts]:
    return [
        NodeFacts(
            engines=tuple(engines or ()),
            engines_unusable=tuple(unusable or ()),
            gpus=len(gpus or ()),
            memory_gb=memory_gb,
        )
        for engines, unusable, gpus, memory_gb in Node.objects.values_list(
            "engines", "engines_unusable", "gpus", "memory_gb"
        )
    ]


def plan_for(mirror_version: MirrorVersion) -> ServePlan:
    """The serve plan of one mirror version, from the database as it is now."""
    indexed = {
        name: (size, mtime_ns) for name, size, mtime_ns in mirror_version.files.values_list("name", "bytes", "mtime_ns")
    }
    files = [FileFacts(name, size) for name, (size, _) in indexed.items()]
    # From the header the scan read (bounded, mirror.header_reader), never from the file on this request.
    kind = kind_of(mirror_version.headers)
    fleet, catalog = fleet_facts(), catalog_facts()
    not_ready = not_ready_on_disk(mirror_version.model, mirror_version.version, indexed) if indexed else ""
    return memory.plan_with_estimate(
        lambda estimated_gb: plan_serve(
            mirror_version.model,
            mirror_version.version,
            files,
            settings.BYTES_URL,
            fleet,
            catalog,
            header_kind=kind,
            not_ready=not_ready,
            estimated_gb=estimated_gb,
        ),
        mirror_version.headers,
    )


# llama.cpp's pooling type that means a reranker (LLAMA_POOLING_TYPE_RANK); any other means embeddings.
POOLING_RANK = 4


def kind_of(headers) -> str:
    """The kind a GGUF's header says: `<arch>.pooling_type` makes it an embedding (or rerank) model; "" for chat."""
    pooling = headers.get("pooling_type") if isinstance(headers, dict) else None
    if isinstance(pooling, bool) or not isinstance(pooling, int):
        return ""
    return Kind.RERANK.value if pooling == POOLING_RANK else Kind.EMBEDDING.value


def header_kind(path: Path) -> str:
    """The kind a GGUF file's header says, read as a scan reads it (bounded); "" when it cannot be read."""
    return kind_of(read_version({path.name: path}))


def add_model(model: Model, profiles: list[Profile], added_by: str) -> Model:
    """Save a new catalog entry made here (not declared), or raise ServeError saying what is wrong."""
    model.added_by = added_by
    model.declared = False
    with transaction.atomic():
        try:
            model.full_clean()
        except ValidationError as error:
            raise serve_error(error) from None
        try:
            model.save()
        except IntegrityError:
            # Added by somebody else between the check above and this save.
            raise ServeError("name", f"a model called {model.name} is already in the catalog") from None
        for profile in profiles:
            profile.model = model
            try:
                profile.full_clean()
            except ValidationError as error:
                raise serve_error(error) from None
            profile.save()
    return model


def serve_error(error: ValidationError) -> ServeError:
    """Every problem of a ValidationError, as the fields and sentences the form shows."""
    if not hasattr(error, "error_dict"):
        return ServeError.of([("name", message) for message in error.messages])
    return ServeError.of(
        [(field, message) for field, errors in error.error_dict.items() for e in errors for message in e.messages]
    )
