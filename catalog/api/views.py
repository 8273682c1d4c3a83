from rest_framework import viewsets
from rest_framework.exceptions import PermissionDenied

from ..models import Model
from .serializers import ModelSerializer


class ModelViewSet(viewsets.ModelViewSet):
    """The catalog. A model declared in configuration can be read here but not written."""

    queryset = Model.objects.prefetch_related("profiles")
    serializer_class = ModelSerializer

    def perform_create(self, serializer):
        serializer.save(added_by=self.request.user.get_username(), declared=False)

    # Refused before the body is read, so the answer is the reason and not a
    # list of field errors about an edit that could never be made.
    def update(self, request, *args, **kwargs):
        self._refuse_declared(self.get_object())
        return super().update(request, *args, **kwargs)

    def destroy(self, request, *args, **kwargs):
        self._refuse_declared(self.get_object())
        return super().destroy(request, *args, **kwargs)

    def _refuse_declared(self, model: Model) -> None:
        if model.declared:
            raise PermissionDenied(
                f"{model.name} is declared in configuration (LLMGW_CATALOG); edit it there rather than here"
            )
