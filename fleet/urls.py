from django.urls import path

from . import views

app_name = "fleet"

urlpatterns = [
    path("fetches/", views.fetches, name="fetches"),
    path("progress/", views.source_progress, name="progress"),
]
