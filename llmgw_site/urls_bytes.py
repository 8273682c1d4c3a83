"""The byte listener: the mirror's files and manifests, GET and HEAD, nothing else, to the fleet's nodes only."""

from django.conf import settings
from django.urls import path, re_path

from common.health import bytes_health
from contracts.sources import SEED_ALIAS
from fleet.enrolment import EnrolledNodes
from mirror import bytes_views
from mirror import tracker as tracker_views
from mirror.bytes_auth import only_the_fleet

# The nodes' token hashes as this process believes them: read at most once per LLMGW_BYTES_PASS_CACHE_S
# per node, each read on a connection closed at once, so no client holds a database connection (issue 33).
ENROLLED = EnrolledNodes(ttl=settings.BYTES_PASS_CACHE_S, close_after_read=True)


def fleet_only(view):
    # Wired here, at the top layer: the mirror checks a node's pass, the fleet knows the nodes.
    return only_the_fleet(view, ENROLLED)


def tracker(request):
    return tracker_views.announce(request, ENROLLED)


urlpatterns = [
    # For a load balancer or systemd: open to all, it names only what it checked (docs/observability.md).
    path("healthz", bytes_health),
    # Peers of a torrent, for the nodes (issue 24); before the model patterns, and without a
    # slash, so that no model's name can shadow it.
    path("announce", fleet_only(tracker)),
    # A file under another address, so that one node may fetch over several connections (a web
    # seed URL each); a hidden folder's name, which no model can have.
    path(f"{SEED_ALIAS}/<int:n>/<str:model>/<str:version>/<str:name>", fleet_only(bytes_views.seed_alias)),
    path("", fleet_only(bytes_views.model_list)),
    path("<str:model>/", fleet_only(bytes_views.version_list)),
    path("<str:model>/<str:version>/", fleet_only(bytes_views.manifest)),
    path("<str:model>/<str:version>/<str:name>", fleet_only(bytes_views.file)),
    # Everything else, including every path that tried to climb out of the root,
    # gets the same JSON 404: no hint of what exists elsewhere (and, to a stranger, 401).
    re_path(r"^.*$", fleet_only(bytes_views.not_found)),
]

handler400 = "mirror.bytes_views.bad_request"
handler404 = "mirror.bytes_views.not_found"
handler500 = "mirror.bytes_views.server_error"
