"""The serve page: one mirrored version offered as a catalog entry, pre-filled from its plan."""

from __future__ import annotations

from django.conf import settings
from django.contrib import admin, messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.template.defaultfilters import filesizeformat
from django.urls import reverse
from django.views.decorators.http import require_http_methods, require_safe
from django_htmx.http import HttpResponseClientRedirect

from common.permissions import forbidden_unless, staff_with
from mirror.models import MirrorVersion

from . import memory, services
from .forms import ServeForm


# Reading the plan needs what it reads; serving adds a catalog model, as the catalog's own add page does.
@require_http_methods(["GET", "HEAD", "POST"])
@staff_with("mirror.view_mirrorversion", "catalog.view_model")
def serve_version(request: HttpRequest, model: str, version: str) -> HttpResponse:
    if request.method == "POST" and (refusal := forbidden_unless(request, "catalog.add_model")):
        return refusal
    mirror_version = get_object_or_404(MirrorVersion, model=model, version=version)
    plan = services.plan_for(mirror_version)
    form = ServeForm.for_plan(plan, settings.BYTES_URL)
    estimate_url = reverse("serve-estimate", args=[model, version])
    memory.wire(form, estimate_url)
    if request.method == "POST" and not plan.refusal:
        form = ServeForm(request.POST, byte_base=settings.BYTES_URL)
        memory.wire(form, estimate_url)
        entry = form.save(added_by=request.user.get_username())
        if entry is not None:
            messages.success(request, f"Added {entry.name} to the catalog; placement will start its replicas.")
            if form.warning:
                messages.warning(request, form.warning[0].upper() + form.warning[1:] + ".")
            destination = reverse("admin:catalog_model_change", args=[entry.pk])
            return HttpResponseClientRedirect(destination) if request.htmx else redirect(destination)

    context = {
        **admin.site.each_context(request),
        "title": f"Serve {model}/{version}",
        "mirror_version": mirror_version,
        "plan": plan,
        "total_size": filesizeformat(plan.bytes_total),
        "form": form,
        # Which figure fills the memory field, and its parts, for what the form says now.
        "memory": memory.for_form(mirror_version.headers, request.POST, plan.bytes_total)
        if request.method == "POST"
        else plan.memory,
        "follow": request.method != "POST" or memory.follows(request.POST),
    }
    # Whole page, or just the form when htmx submitted it.
    template = "serving/partials/serve_form.html" if request.htmx else "serving/serve.html"
    refused = form.errors or (request.method == "POST" and plan.refusal)
    # htmx swaps in only a 2xx answer; the form with its sentences is the answer it asked for.
    status = 400 if refused and not request.htmx else 200
    return render(request, template, context, status=status)


@require_safe
@staff_with("mirror.view_mirrorversion")
def serve_estimate(request: HttpRequest, model: str, version: str) -> HttpResponse:
    """The memory estimate for the pool as typed: the serve page asks for it on every keystroke (htmx).

    The memory field follows (swapped out of band) unless staff wrote their own number in it.
    """
    mirror_version = get_object_or_404(MirrorVersion, model=model, version=version)
    total = sum(mirror_version.files.values_list("bytes", flat=True))
    offer = memory.for_form(mirror_version.headers, request.GET, total)
    context = {"memory": offer, "follow": memory.follows(request.GET)}
    return render(request, "serving/partials/memory_estimate.html", context)
