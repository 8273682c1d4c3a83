from django.urls import path

from . import views

urlpatterns = [
    path("progress/", views.ProgressView.as_view(), name="api-progress"),
]
