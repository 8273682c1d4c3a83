from django.urls import path

from . import views

app_name = "agent"

urlpatterns = [
    path("fetches/", views.fetches, name="fetches"),
    path("progress/", views.source_progress, name="progress"),
]
