"""The byte listener: the mirror's files and manifests, GET and HEAD, nothing else."""

from django.urls import path, re_path

from mirror import bytes_views

urlpatterns = [
    path("", bytes_views.model_list),
    path("<str:model>/", bytes_views.version_list),
    path("<str:model>/<str:version>/", bytes_views.manifest),
    path("<str:model>/<str:version>/<str:name>", bytes_views.file),
    # Everything else, including every path that tried to climb out of the root,
    # gets the same JSON 404: no hint of what exists elsewhere.
    re_path(r"^.*$", bytes_views.not_found),
]

handler404 = "mirror.bytes_views.not_found"
handler500 = "mirror.bytes_views.server_error"
