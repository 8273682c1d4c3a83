"""The catalog's writes and the facts the serve plan is made from."""

from __future__ import annotations

import logging

from celery import current_app
from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import IntegrityError, connection, transaction

from .models import Model, Profile
from .planning import CatalogFacts, FileFacts, NodeFacts, ServeError, ServePlan, plan_serve

log = logging.getLogger(__name__)


def send_reconcile() -> None:
    """Ask the control plane to place replicas for the catalog as it now is.

    Sent by name so the catalog does not import placement. A broker that is down
    never breaks a save: the catalog row is the record, and the next reconcile,
    whatever starts it, places from it.
    """
    try:
        current_app.send_task("fleet.reconcile", queue="control", retry_policy={"max_retries": 2})
    except Exception as error:  # any broker failure: the save itself succeeded
        log.warning("catalog saved, but fleet.reconcile could not be queued: %s", error)


def reconcile_after_commit() -> None:
    """Queue one fleet.reconcile once the current transaction commits (however many rows it wrote)."""
    # run_on_commit holds (savepoints, callback, robust) for what this transaction has queued so far.
    if not any(send_reconcile in queued for queued in connection.run_on_commit):
        transaction.on_commit(send_reconcile)


def catalog_facts() -> CatalogFacts:
    declared, taken = set(), set()
    for name, aliases, is_declared in Model.objects.values_list("name", "aliases", "declared"):
        taken.add(name)
        taken.update(aliases or [])
        if is_declared:
            declared.add(name)
    return CatalogFacts(declared=frozenset(declared), taken=frozenset(taken))


def fleet_facts() -> list[NodeFacts]:
    from fleet.models import Node

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


def plan_for(mirror_version) -> ServePlan:
    """The serve plan of one mirror version, from the database as it is now."""
    files = [FileFacts(name, size) for name, size in mirror_version.files.values_list("name", "bytes")]
    return plan_serve(
        mirror_version.model, mirror_version.version, files, settings.BYTES_URL, fleet_facts(), catalog_facts()
    )


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
    """The first problem of a ValidationError, as the field and sentence the form shows."""
    if hasattr(error, "error_dict"):
        field, errors = next(iter(error.error_dict.items()))
        return ServeError(field, errors[0].messages[0])
    return ServeError("name", error.messages[0])
