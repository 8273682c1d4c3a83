"""The admin port's Django pages: admin, serve pages and the DRF API. The /v1/ gateway is in asgi.py."""

from django.contrib import admin
from django.urls import include, path
from django.views.generic import RedirectView
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from catalog.api.views import ServePlanView, ServeView
from catalog.views import serve_version

api_patterns = [
    path("mirror/", include("mirror.api.urls")),
    path("", include("agent.api.urls")),
    path("catalog/", include("catalog.api.urls")),
    path("fleet/", include("fleet.api.urls")),
    path("gateway/", include("gateway.api.urls")),
    path("serve/plan/", ServePlanView.as_view(), name="serve-plan"),
    path("serve/", ServeView.as_view(), name="serve"),
    path("schema/", SpectacularAPIView.as_view(), name="schema"),
    path("docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
]

urlpatterns = [
    path("", RedirectView.as_view(url="/admin/", permanent=False)),
    path("admin/", admin.site.urls),
    path("api/", include(api_patterns)),
    path("fleet/", include("agent.urls")),
    path("serve/<str:model>/<str:version>/", serve_version, name="serve-version"),
]
