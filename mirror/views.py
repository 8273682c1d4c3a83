"""The admin's "Pull a version" page: a version copied from another llmgw mirror (mirror.pull), with its progress.

Staff only (wired through the mirror admin's `admin_view`): reading a pull needs
mirror.view_mirrorpull, starting one mirror.pull_version (docs/roles.md). One view serves each page and
its fragment, switching on `request.htmx`: the pages poll their fragment every second.
"""

from __future__ import annotations

from django import forms
from django.contrib import admin
from django.db import transaction
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.views.decorators.http import require_http_methods, require_safe
from django_htmx.http import HttpResponseClientRedirect

from common.permissions import forbidden_unless, staff_with

from . import pull
from .models import MirrorPull

RECENT = 10


class PullForm(forms.Form):
    url = forms.CharField(
        label="Version's address",
        max_length=1000,
        widget=forms.TextInput(
            attrs={"class": "vTextField wide", "placeholder": "https://central:8001/model/version/"}
        ),
        help_text="The version on the other mirror's byte listener, ending in /<model>/<version>/.",
    )
    node = forms.CharField(
        label="This site's node name there",
        max_length=100,
        required=False,
        help_text="The other byte listener serves only its fleet: this site is one of its nodes there.",
    )
    token = forms.CharField(
        label="Its token",
        required=False,
        strip=True,
        widget=forms.PasswordInput(render_value=False, attrs={"autocomplete": "off"}),
        help_text="What `manage.py node_token NAME` printed on the other site. Kept only while the pull runs. "
        "Leave both empty for a public mirror.",
    )


def _context(request: HttpRequest, **extra) -> dict:
    return {**admin.site.each_context(request), "pulls": MirrorPull.objects.all()[:RECENT], **extra}


@require_http_methods(["GET", "HEAD", "POST"])
@staff_with("mirror.view_mirrorpull")
def pull_page(request: HttpRequest) -> HttpResponse:
    if request.method == "POST" and (refusal := forbidden_unless(request, "mirror.pull_version")):
        return refusal
    form = PullForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        try:
            record = pull.start(data["url"], data["node"], data["token"], requested_by=request.user.get_username())
        except pull.PullError as error:
            form.add_error(None, str(error))
        else:
            from .tasks import pull_task

            transaction.on_commit(lambda: pull_task.delay(record.pk))
            destination = reverse("admin:mirror_pull_detail", args=[record.pk])
            return HttpResponseClientRedirect(destination) if request.htmx else redirect(destination)
    context = _context(request, title="Pull a version from another mirror", form=form)
    template = "mirror/partials/pull_form.html" if request.htmx else "mirror/pull.html"
    status = 400 if form.errors and not request.htmx else 200
    return render(request, template, context, status=status)


@require_safe
@staff_with("mirror.view_mirrorpull")
def pull_detail(request: HttpRequest, pk: int) -> HttpResponse:
    record = get_object_or_404(MirrorPull, pk=pk)
    context = _context(request, title=f"Pull of {record.model}/{record.version}", pull=record)
    template = "mirror/partials/pull_state.html" if request.htmx else "mirror/pull_detail.html"
    return render(request, template, context)


@require_safe
@staff_with("mirror.view_mirrorpull")
def pull_list(request: HttpRequest) -> HttpResponse:
    """The recent pulls, for the versions' list (polled)."""
    return render(request, "mirror/partials/pulls.html", _context(request))
