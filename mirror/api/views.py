from rest_framework import viewsets

from ..models import MirrorVersion
from .serializers import MirrorVersionDetailSerializer, MirrorVersionSerializer


class MirrorVersionViewSet(viewsets.ReadOnlyModelViewSet):
    """Versions in the mirror's index, with their files on the detail route."""

    queryset = MirrorVersion.objects.with_totals().prefetch_related("files")

    def get_serializer_class(self):
        return MirrorVersionDetailSerializer if self.action == "retrieve" else MirrorVersionSerializer

    filterset_fields = ["model"]
