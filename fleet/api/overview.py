"""/api/fleet/overview/: the fleet's figures on the admin's front page, as the page shows them (fleet.overview)."""

from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from common.permissions import OVERVIEW, requires

from .. import overview


class NodeBarSerializer(serializers.Serializer):
    name = serializers.CharField()
    total = serializers.IntegerField(help_text="Its memory, whole GB.")
    placed = serializers.IntegerField(help_text="What placement booked on it, whole GB.")
    percent = serializers.IntegerField()
    ready = serializers.BooleanField()
    in_use = serializers.IntegerField(
        allow_null=True,
        help_text="Bytes its engines hold as it last measured them (the page's 'in use'); null when not measured.",
    )


class NodesSerializer(serializers.Serializer):
    ready = serializers.IntegerField()
    draining = serializers.IntegerField()
    not_ready = serializers.IntegerField()
    total = serializers.IntegerField()
    memory_gb = serializers.IntegerField(help_text="Every node's memory, whole GB.")
    memory_placed_gb = serializers.IntegerField(help_text="What placement booked, whole GB.")
    bars = NodeBarSerializer(many=True, help_text="Memory placed per node: the fullest, as the page draws them.")
    bars_hidden = serializers.IntegerField(help_text="Nodes not among the bars.")


class StateCountSerializer(serializers.Serializer):
    state = serializers.CharField()
    count = serializers.IntegerField()


class EngineRowSerializer(serializers.Serializer):
    model = serializers.CharField()
    replicas = serializers.IntegerField(help_text="Its replicas whose engines posted their figures lately.")
    slots = serializers.IntegerField()
    busy = serializers.IntegerField(help_text="Slots decoding a request now.")
    deferred = serializers.IntegerField(help_text="Requests waiting for a slot.")
    kv_percent = serializers.IntegerField(help_text="KV cache used, percent, averaged over its replicas.")
    tokens_per_second = serializers.FloatField(help_text="Generated, summed over its replicas.")


class FetchRowSerializer(serializers.Serializer):
    node = serializers.CharField()
    source = serializers.CharField()
    state = serializers.CharField()
    percent = serializers.IntegerField()
    bytes_done = serializers.IntegerField()
    bytes_total = serializers.IntegerField()
    rate = serializers.IntegerField(help_text="bytes a second")


class FleetOverviewSerializer(serializers.Serializer):
    nodes = NodesSerializer()
    replicas = StateCountSerializer(many=True, help_text="Replicas per state.")
    engines = EngineRowSerializer(
        many=True, help_text="The engines' live figures per model (the 'Engine slots' table)."
    )
    fetches = FetchRowSerializer(many=True, help_text="Fetches under way; /api/progress/?source= has one source's.")


class FleetOverviewView(APIView):
    """The fleet as the admin's front page shows it: nodes, memory placed, replicas, engines, fetches under way."""

    permission_classes = [requires(*OVERVIEW)]

    @extend_schema(responses=FleetOverviewSerializer)
    def get(self, request):
        figures = {
            "nodes": overview.nodes(),
            "replicas": overview.replicas(),
            "engines": overview.engines(),
            "fetches": overview.fetches_under_way(),
        }
        return Response(FleetOverviewSerializer(figures).data)
