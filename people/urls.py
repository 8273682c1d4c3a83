from django.urls import path

from . import views

app_name = "people"
urlpatterns = [
    path("", views.me, name="me"),
    path("login/", views.LoginView.as_view(), name="login"),
    path("keys/", views.make_key, name="make-key"),
    path("keys/<int:key_id>/revoke/", views.revoke_key, name="revoke-key"),
    path("secret/", views.secret, name="secret"),
    path("teams/<int:team_id>/members/", views.add_member, name="add-member"),
    path("members/<int:member_id>/remove/", views.remove_member, name="remove-member"),
]
