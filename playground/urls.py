from django.urls import path

from . import views

app_name = "playground"
urlpatterns = [
    path("", views.playground, name="index"),
    path("stream/", views.stream, name="stream"),
    path("code/", views.show_code, name="code"),
]
