"""The replica routes as the lead will wire them, for tests until they are in llmgw_site/urls.py."""

from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/fleet/", include("fleet.api_replicas")),
]
