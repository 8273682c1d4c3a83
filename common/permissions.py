"""Who may do what on the admin port: Django's model permissions, with a sentence for every "no".

Being staff only lets a person in; what they may then read or do is their permissions,
given by the two groups common/migrations makes (docs/roles.md): "llmgw viewers" read
everything and change nothing, "llmgw operators" also change, and hold the permissions of
the actions no model permission covers (LLMGW_ACTIONS). Every page, admin action and API
endpoint asks one of these functions, so a view-only staff member cannot mint a node's
token, rotate a key or serve a model by finding a door that forgot to ask.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps

from django.contrib.admin.views.decorators import staff_member_required
from django.http import HttpRequest, HttpResponse, HttpResponseForbidden
from rest_framework.permissions import SAFE_METHODS, BasePermission, DjangoModelPermissions

VIEWERS = "llmgw viewers"
OPERATORS = "llmgw operators"
# The apps whose models the groups cover.
# auditlog: the audit log (docs/audit.md), which both groups read and neither writes.
LLMGW_APPS = ("mirror", "catalog", "fleet", "gateway", "auditlog")
# llmgw's models in an app it shares: accounts' teams are llmgw's, its API tokens and provider accounts are not
# (they stay a superuser's, with users and groups).
LLMGW_MODELS = ("accounts.team", "accounts.teammember")
# What the overview on the admin's front page draws from.
OVERVIEW = ("fleet.view_node", "fleet.view_replica", "fleet.view_fetch", "gateway.view_usage")


def refusal(perms: tuple[str, ...] | list[str]) -> str:
    """The sentence a refused staff member reads: what was missing and who has it."""
    return (
        f"You may not do this: it needs the permission {', '.join(perms)}, which your account does not have "
        f'(the group "{OPERATORS}" has every llmgw permission, "{VIEWERS}" only those to read).'
    )


def is_llmgw(model) -> bool:
    """Whether the groups cover `model` (a model class): every model of llmgw's apps, and the few of LLMGW_MODELS."""
    return model._meta.app_label in LLMGW_APPS or model._meta.label_lower in LLMGW_MODELS


def reads_llmgw(user) -> bool:
    """Staff with a permission on any of llmgw's models: the schema, the API's index pages and the overview's frame."""
    if not (user and user.is_active and user.is_staff):
        return False
    if any(user.has_module_perms(a) for a in LLMGW_APPS):
        return True
    return any(user.has_perm(f"{app}.view_{model}") for app, model in (m.split(".") for m in LLMGW_MODELS))


def staff_with(*perms: str) -> Callable:
    """A page for staff who hold `perms`: others signed in get 403 and the sentence, strangers the login page."""

    def decorate(view: Callable) -> Callable:
        @wraps(view)
        def checked(request: HttpRequest, *args, **kwargs) -> HttpResponse:
            if not request.user.has_perms(perms):
                return HttpResponseForbidden(refusal(perms), content_type="text/plain; charset=utf-8")
            return view(request, *args, **kwargs)

        return staff_member_required(checked)

    return decorate


def forbidden_unless(request: HttpRequest, *perms: str) -> HttpResponse | None:
    """The 403 for a request whose user lacks `perms`, or None: for a view whose write needs more than its read."""
    if request.user.has_perms(perms):
        return None
    return HttpResponseForbidden(refusal(perms), content_type="text/plain; charset=utf-8")


class ModelPermissions(DjangoModelPermissions):
    """The API's default: staff, and the model's permission for the method (reading needs `view_`).

    DRF's own DjangoModelPermissions lets any signed-in user read; IsAdminUser let any
    staff member write. The refusal names the permission that was missing.
    """

    perms_map = {
        **DjangoModelPermissions.perms_map,
        "GET": ["%(app_label)s.view_%(model_name)s"],
        "HEAD": ["%(app_label)s.view_%(model_name)s"],
        "OPTIONS": ["%(app_label)s.view_%(model_name)s"],
    }

    def has_permission(self, request, view) -> bool:
        user = request.user
        if not (user and user.is_authenticated and user.is_active and user.is_staff):
            return False
        if getattr(view, "_ignore_model_permissions", False):
            # The routers' index pages: a list of addresses, for staff who may read something.
            return reads_llmgw(user)
        queryset = self._queryset(view)
        perms = self.get_required_permissions(request.method, queryset.model)
        if user.has_perms(perms):
            return True
        self.message = refusal(perms)
        return False


def requires(*perms: str, to_read: tuple[str, ...] | None = None) -> type[BasePermission]:
    """A permission class for an API view without a model of its own: staff holding `perms`.

    `to_read`: what GET, HEAD and OPTIONS need instead, for a view whose reads need less than its writes.
    """

    class Requires(BasePermission):
        def has_permission(self, request, view) -> bool:
            user = request.user
            needed = to_read if to_read is not None and request.method in SAFE_METHODS else perms
            self.message = refusal(needed)
            return bool(user and user.is_authenticated and user.is_active and user.is_staff and user.has_perms(needed))

    Requires.__name__ = f"Requires({', '.join(perms)})"
    return Requires


class ReadsLlmgw(BasePermission):
    """The API's schema and its Swagger page: staff who may read something of llmgw."""

    message = refusal(["a view permission of llmgw"])

    def has_permission(self, request, view) -> bool:
        return reads_llmgw(request.user)
