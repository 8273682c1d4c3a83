from django.conf import settings
from django.shortcuts import get_object_or_404
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import status, viewsets
from rest_framework.exceptions import PermissionDenied
from rest_framework.response import Response
from rest_framework.views import APIView

from mirror.models import MirrorVersion

from .. import services
from ..models import Model
from ..planning import ServeError, build_model
from .serializers import ModelSerializer


class ModelViewSet(viewsets.ModelViewSet):
    """The catalog. A model declared in configuration can be read here but not written."""

    queryset = Model.objects.prefetch_related("profiles")
    serializer_class = ModelSerializer

    def perform_create(self, serializer):
        serializer.save(added_by=self.request.user.get_username(), declared=False)

    def perform_update(self, serializer):
        self._refuse_declared(serializer.instance)
        serializer.save()

    def perform_destroy(self, instance):
        self._refuse_declared(instance)
        instance.delete()

    def _refuse_declared(self, model: Model) -> None:
        if model.declared:
            raise PermissionDenied(
                f"{model.name} is declared in configuration (LLMGW_CATALOG); edit it there rather than here"
            )


class ServePlanView(APIView):
    """What serving one mirrored version would mean: the serve page's pre-filled form, as JSON."""

    @extend_schema(
        parameters=[OpenApiParameter("model", str, required=True), OpenApiParameter("version", str, required=True)],
        responses={200: dict},
    )
    def get(self, request):
        model, version = request.query_params.get("model", ""), request.query_params.get("version", "")
        if not model or not version:
            return Response({"error": "say which version: ?model=M&version=V"}, status=status.HTTP_400_BAD_REQUEST)
        mirror_version = MirrorVersion.objects.filter(model=model, version=version).first()
        if mirror_version is None:
            return Response({"error": f"the mirror has no version {model}/{version}"}, status=status.HTTP_404_NOT_FOUND)
        return Response(services.plan_for(mirror_version).as_dict())


class ServeView(APIView):
    """Put a version into service: the serve page's form, for automation. Fields as the form has them."""

    @extend_schema(request=dict, responses={201: ModelSerializer})
    def post(self, request):
        form = {k: v for k, v in request.data.items() if isinstance(v, str | int)}
        try:
            model, profile = build_model({k: str(v) for k, v in form.items()}, settings.BYTES_URL)
            services.add_model(model, [profile], request.user.get_username())
        except ServeError as error:
            return Response({"field": error.field, "error": error.sentence}, status=status.HTTP_400_BAD_REQUEST)
        model = get_object_or_404(Model.objects.prefetch_related("profiles"), pk=model.pk)
        return Response(ModelSerializer(model).data, status=status.HTTP_201_CREATED)
