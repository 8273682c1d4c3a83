"""The admin port's Django pages: admin, serve pages and the DRF API. The /v1/ gateway is in asgi.py."""

from django.contrib import admin
from django.urls import include, path
from django.views.generic import RedirectView
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from common.audit_api import AuditEntryViewSet
from common.health import admin_health
from common.metrics import metrics_view
from fleet.api.progress import ProgressView
from serving.urls import api_urlpatterns as serving_api

api_patterns = [
    path("mirror/", include("mirror.api.urls")),
    path("progress/", ProgressView.as_view(), name="api-progress"),
    path("audit/", AuditEntryViewSet.as_view({"get": "list"}), name="api-audit"),
    path("audit/<int:pk>/", AuditEntryViewSet.as_view({"get": "retrieve"}), name="api-audit-detail"),
    path("catalog/", include("catalog.api.urls")),
    path("fleet/", include("fleet.api.urls")),
    path("gateway/", include("gateway.api.urls")),
    path("people/", include("people.api.urls")),
    *serving_api,
    path("schema/", SpectacularAPIView.as_view(), name="schema"),
    path("docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
]

urlpatterns = [
    path("", RedirectView.as_view(url="/admin/", permanent=False)),
    path("admin/", admin.site.urls),
    path("metrics", metrics_view, name="metrics"),
    path("healthz", admin_health, name="healthz"),
    path("oidc/", include("accounts.urls")),
    path("api/", include(api_patterns)),
    path("fleet/", include("fleet.urls")),
    path("me/", include("people.urls")),
    path("playground/", include("playground.urls")),
    path("", include("serving.urls")),
]
