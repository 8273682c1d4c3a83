from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from common.permissions import requires
from contracts import progress

from ..live import redis_client
from ..models import Node
from .serializers import ProgressSerializer


class ProgressView(APIView):
    """Every enrolled node's progress on a source, read from Redis under each node's prefix."""

    permission_classes = [requires("fleet.view_fetch")]

    @extend_schema(
        parameters=[
            OpenApiParameter("source", str, required=True, description="a mirror address; a version ends in /")
        ],
        responses=ProgressSerializer,
    )
    def get(self, request):
        source = request.query_params.get("source", "").strip()
        if not source:
            raise ValidationError({"source": "say which source: ?source=http://mirror:8001/<model>/<version>/"})
        snapshots = progress.read(redis_client(), source, Node.objects.values_list("name", flat=True))
        nodes = [dict(snapshot, node=node) for node, snapshot in snapshots.items()]
        return Response(ProgressSerializer({"source": source, "nodes": nodes}).data)
