"""The serve page: one mirrored version offered as a catalog entry, pre-filled from its plan."""

from __future__ import annotations

from dataclasses import dataclass

from django.conf import settings
from django.contrib import admin, messages
from django.contrib.admin.views.decorators import staff_member_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.template.defaultfilters import filesizeformat
from django.urls import reverse
from django_htmx.http import HttpResponseClientRedirect

from mirror.models import MirrorVersion

from . import services
from .models import Engine
from .planning import ServeError, ServePlan, build_model


@dataclass
class Field:
    name: str
    label: str
    value: str = ""
    help: str = ""
    error: str = ""
    choices: tuple[tuple[str, str], ...] = ()
    wide: bool = False


@dataclass
class Fieldset:
    title: str
    fields: list[Field]


def form_fields(plan: ServePlan, submitted: dict[str, str] | None, error: ServeError | None) -> list[Fieldset]:
    """The form's fields in fieldsets, filled from what was submitted or else from the plan."""
    initial = {
        "name": plan.model,
        "source": plan.source,
        "engine": plan.engine,
        "profile": plan.profile,
        "min_memory_gb": str(plan.min_memory_gb or ""),
    }
    values = submitted if submitted is not None else initial
    fieldsets = [
        Fieldset(
            "The catalog entry",
            [
                Field("name", "Name", help="What clients ask for."),
                Field("description", "Description", wide=True),
                Field("aliases", "Aliases", help="Other names clients may use, comma-separated."),
                Field(
                    "source", "Source", help="On the byte listener; a trailing / names the whole version.", wide=True
                ),
            ],
        ),
        Fieldset(
            "What clients get",
            [
                Field("context_length", "Context length", help="The most tokens one request may use."),
                Field("max_output", "Output limit", help="The most tokens one reply may have; blank for no limit."),
                Field("replicas", "Replicas", help="How many copies to keep running."),
            ],
        ),
        Fieldset(
            "Where and how it runs",
            [
                Field("engine", "Engine", choices=(("", "—"), *((e.value, e.label) for e in Engine))),
                Field("profile", "Profile", help="Named for the hardware it runs on."),
                Field(
                    "ctx_size",
                    "Engine context pool",
                    help="llama.cpp's --ctx-size, shared by its parallel slots; blank for the engine's default.",
                ),
                Field("min_memory_gb", "Min memory (GB)", help="Estimated from the weights: size × 1.5 + 2."),
                Field("selector_key", "Node selector key", help="A label nodes must carry, e.g. size."),
                Field("selector_value", "Node selector value", help="Its value, e.g. large."),
            ],
        ),
    ]
    for fieldset in fieldsets:
        for field in fieldset.fields:
            field.value = values.get(field.name, "")
            if error is not None and error.field == field.name:
                field.error = error.sentence
    return fieldsets


@staff_member_required
def serve_version(request: HttpRequest, model: str, version: str) -> HttpResponse:
    mirror_version = get_object_or_404(MirrorVersion, model=model, version=version)
    plan = services.plan_for(mirror_version)
    submitted, error = None, None
    if request.method == "POST" and not plan.refusal:
        submitted = {key: request.POST.get(key, "") for key in request.POST if key != "csrfmiddlewaretoken"}
        try:
            entry, profile = build_model(submitted, settings.BYTES_URL)
            services.add_model(entry, [profile], request.user.get_username())
        except ServeError as refused:
            error = refused
        else:
            messages.success(request, f"Added {entry.name} to the catalog; placement will start its replicas.")
            destination = reverse("admin:catalog_model_change", args=[entry.pk])
            return HttpResponseClientRedirect(destination) if request.htmx else redirect(destination)

    context = {
        **admin.site.each_context(request),
        "title": f"Serve {model}/{version}",
        "mirror_version": mirror_version,
        "plan": plan,
        "total_size": filesizeformat(plan.bytes_total),
        "fieldsets": form_fields(plan, submitted, error),
        "error": error,
    }
    # Whole page, or just the form when htmx submitted it.
    template = "catalog/partials/serve_form.html" if request.htmx else "catalog/serve.html"
    refused = error is not None or (request.method == "POST" and plan.refusal)
    # htmx swaps in only a 2xx answer; the form with its sentences is the answer it asked for.
    status = 400 if refused and not request.htmx else 200
    return render(request, template, context, status=status)
