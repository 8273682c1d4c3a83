"""/me/: a person's teams and what is left of their budgets, their keys, and their usage (docs/teams.md).

Every view is for a signed-in person, staff or not; what each sees is people/access.py's to say.
"""

from __future__ import annotations

from functools import wraps

from django.contrib.auth import views as auth_views
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse_lazy
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_POST

from accounts.models import TeamMember
from common import one_time
from gateway.models import ApiKey

from . import access, services
from .budgets import booked, team_budgets, today
from .chart import usage_chart
from .forms import KeyForm, MemberForm

LOGIN_URL = reverse_lazy("people:login")


def signed_in(view):
    """Signed-in people only, and nothing of it kept by a browser or a proxy."""
    return never_cache(login_required(view, login_url=LOGIN_URL))


class LoginView(auth_views.LoginView):
    """A local account's sign-in for anyone (the admin's takes staff only)."""

    template_name = "people/login.html"
    redirect_authenticated_user = True
    next_page = reverse_lazy("people:me")


@signed_in
def me(request, key_form: KeyForm | None = None, problem: str = "", status: int = 200) -> HttpResponse:
    user = request.user
    last_day = today()
    teams = []
    memberships = {m.team_id: m for m in TeamMember.objects.filter(user=user)}
    for team in access.teams_of(user).order_by("name"):
        runs = memberships[team.pk].role == TeamMember.Role.ADMIN
        entry = {
            "team": team,
            "role": memberships[team.pk].get_role_display(),
            "runs": runs,
            "budgets": team_budgets(team),
            "members": team.members.select_related("user").order_by("user__username"),
        }
        if runs:
            entry["keys"] = team.keys.select_related("owner").order_by("name")
            team_usage = access.usage(user).filter(key__team=team)
            entry["chart"] = usage_chart(team_usage, last_day)
            entry["month"] = booked(team_usage, last_day.replace(day=1))
            entry["member_form"] = MemberForm(prefix=f"team{team.pk}")
        teams.append(entry)
    context = {
        "teams": teams,
        "keys": ApiKey.objects.filter(owner=user).select_related("team").order_by("name"),
        "chart": usage_chart(access.usage(user).filter(key__owner=user), last_day),
        "month": booked(access.usage(user).filter(key__owner=user), last_day.replace(day=1)),
        "key_form": key_form or KeyForm(user),
        "problem": problem,
    }
    return render(request, "people/me.html", context, status=status)


@require_POST
@signed_in
def make_key(request) -> HttpResponse:
    form = KeyForm(request.user, request.POST)
    if not form.is_valid():
        return me(request, key_form=form, status=400)
    try:
        key, secret = services.make_key(
            request.user, form.cleaned_data["name"], form.cleaned_data["team"], form.model_names(), form.expiry()
        )
    except services.Problem as problem:
        return me(request, key_form=form, problem=str(problem), status=400)
    # The secret waits server-side for its own page (common.one_time): never in a message or a cookie.
    one_time.keep(request, f'API key "{key.name}" of {key.team}', secret)
    return redirect("people:secret")


@signed_in
def secret(request) -> HttpResponse:
    return render(request, "people/secret.html", {"secrets": one_time.take(request)})


def _not_found_as_404(view):
    @wraps(view)
    def answered(request, *args, **kwargs):
        try:
            return view(request, *args, **kwargs)
        except services.NotFound as error:
            raise Http404(str(error)) from None
        except services.Problem as problem:
            return me(request, problem=str(problem), status=400)

    return answered


@require_POST
@signed_in
@_not_found_as_404
def revoke_key(request, key_id: int) -> HttpResponse:
    key = services.revoke_key(request.user, key_id)
    if request.htmx:
        return render(request, "people/partials/key_row.html", {"key": key, "revocable": True})
    return redirect("people:me")


@require_POST
@signed_in
@_not_found_as_404
def add_member(request, team_id: int) -> HttpResponse:
    form = MemberForm(request.POST, prefix=f"team{team_id}")
    if not form.is_valid():
        return me(request, problem="Name a person by username or email, and a role.", status=400)
    services.add_member(request.user, team_id, form.cleaned_data["who"], form.cleaned_data["role"])
    return redirect("people:me")


@require_POST
@signed_in
@_not_found_as_404
def remove_member(request, member_id: int) -> HttpResponse:
    services.remove_member(request.user, member_id)
    return redirect("people:me")
