from rest_framework import mixins, viewsets

from ..models import Node
from .serializers import NodeSerializer


class NodeViewSet(mixins.UpdateModelMixin, viewsets.ReadOnlyModelViewSet):
    """The fleet's nodes as their agents report them. PATCH sets `draining`, and nothing else."""

    queryset = Node.objects.all()
    serializer_class = NodeSerializer
    http_method_names = ["get", "patch", "head", "options"]
