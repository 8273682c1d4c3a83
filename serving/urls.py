from django.urls import path

from . import views
from .api.views import ServePlanView, ServeView

# The serve page, beside the admin.
urlpatterns = [
    path("serve/<str:model>/<str:version>/", views.serve_version, name="serve-version"),
    path("serve/<str:model>/<str:version>/estimate/", views.serve_estimate, name="serve-estimate"),
]

# Under /api/.
api_urlpatterns = [
    path("serve/plan/", ServePlanView.as_view(), name="serve-plan"),
    path("serve/", ServeView.as_view(), name="serve"),
]
