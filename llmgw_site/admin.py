"""The admin as llmgw's own: its name in the header, the overview as its front page, apps in the order work flows."""

from django.contrib import admin
from django.shortcuts import render
from django.template.response import TemplateResponse
from django.urls import path

from common import one_time
from common.permissions import OVERVIEW
from fleet import overview as fleet_overview
from gateway import overview as usage_overview

# Mirror → catalog → fleet → gateway: a version is mirrored, served, placed and asked.
APP_ORDER = ["mirror", "catalog", "fleet", "gateway", "auth"]


class LlmgwAdminSite(admin.AdminSite):
    site_header = "llmgw"
    site_title = "llmgw"
    index_title = "Mirror, catalog, fleet and gateway"
    index_template = "overview/index.html"

    def get_urls(self):
        return [path("secrets/", self.admin_view(self.one_time_secrets), name="one-time-secrets"), *super().get_urls()]

    def one_time_secrets(self, request):
        """The keys and tokens this user just made, shown once (common.one_time): never in a message or a cookie.

        admin_view sends it with never_cache: no browser or proxy keeps a copy.
        """
        context = {**self.each_context(request), "title": "Shown this once", "secrets": one_time.take(request)}
        return TemplateResponse(request, "admin/one_time_secrets.html", context)

    def index(self, request, extra_context=None):
        """The fleet at a glance above the apps; its fetches under way refresh themselves (htmx).

        Only for staff who may read what it draws: others get the admin's own front page.
        """
        if not request.user.has_perms(OVERVIEW):
            request.current_app = self.name
            context = {
                **self.each_context(request),
                "title": self.index_title,
                "subtitle": None,
                "app_list": self.get_app_list(request),
                **(extra_context or {}),
            }
            return TemplateResponse(request, "admin/index.html", context)
        fetches = fleet_overview.fetches_under_way()
        if request.htmx:
            return render(request, "overview/partials/fetches.html", {"fetches": fetches})
        context = {
            "nodes": fleet_overview.nodes(),
            "replicas": fleet_overview.replicas(),
            "engines": fleet_overview.engines(),
            "fetches": fetches,
            "usage_day": usage_overview.last_24_hours(),
            "usage_month": usage_overview.last_30_days(),
            **(extra_context or {}),
        }
        return super().index(request, context)

    def get_app_list(self, request, app_label=None):
        apps = super().get_app_list(request)
        by_label = {app["app_label"]: app for app in apps}
        # API tokens are how staff and automation sign in to the API: they sit with
        # the users they belong to, not in an app of their own.
        tokens = by_label.pop("accounts", None)
        if tokens is not None and "auth" in by_label:
            by_label["auth"]["models"] = sorted(by_label["auth"]["models"] + tokens["models"], key=lambda m: m["name"])
        elif tokens is not None:
            by_label["accounts"] = tokens
        if app_label is not None:
            # An app's own page: the tokens' page stays reachable by its address.
            return [by_label[app_label]] if app_label in by_label else super().get_app_list(request, app_label)
        rank = {label: i for i, label in enumerate(APP_ORDER)}
        return sorted(by_label.values(), key=lambda app: (rank.get(app["app_label"], len(rank)), app["name"]))
