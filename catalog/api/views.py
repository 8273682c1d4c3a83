from django.conf import settings
from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import serializers, status, viewsets
from rest_framework.exceptions import PermissionDenied
from rest_framework.response import Response
from rest_framework.views import APIView

from mirror.models import MirrorVersion

from .. import services
from ..models import Model
from ..planning import ServeError, build_model
from .serializers import ModelSerializer

SERVE_FORM_FIELDS = (
    "name",
    "description",
    "aliases",
    "source",
    "context_length",
    "max_output",
    "replicas",
    "engine",
    "profile",
    "ctx_size",
    "min_memory_gb",
    "selector_key",
    "selector_value",
)


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


class ServePlanView(APIView):
    """What serving one mirrored version would mean: the serve page's pre-filled form, as JSON."""

    @extend_schema(
        parameters=[OpenApiParameter("model", str, required=True), OpenApiParameter("version", str, required=True)],
        responses={
            200: inline_serializer(
                "ServePlan",
                {
                    "model": serializers.CharField(),
                    "version": serializers.CharField(),
                    "source": serializers.CharField(),
                    "engine": serializers.CharField(),
                    "profile": serializers.CharField(),
                    "files": serializers.IntegerField(help_text="How many files, when more than one."),
                    "bytes_total": serializers.IntegerField(),
                    "min_memory_gb": serializers.IntegerField(),
                    "refusal": serializers.CharField(help_text="Why it cannot be served; empty when it can."),
                    "warning": serializers.CharField(help_text="Why it probably will not run; empty when none."),
                    "already": serializers.BooleanField(),
                    "file_names": serializers.ListField(child=serializers.CharField()),
                },
            )
        },
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
    """Put a version into service: the serve page's form, for automation, with the same fields and sentences."""

    @extend_schema(
        request=inline_serializer(
            "ServeForm", {name: serializers.CharField(required=False) for name in SERVE_FORM_FIELDS}
        ),
        responses={201: ModelSerializer},
    )
    def post(self, request):
        form = {}
        for name in SERVE_FORM_FIELDS:
            value = request.data.get(name)
            if isinstance(value, list) and all(isinstance(v, str) for v in value):
                value = ",".join(value)  # aliases as a JSON list, as the catalog API writes them
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, str | int):
                return Response(
                    {"field": name, "error": f"{name} must be written as text or a number"},
                    status=status.HTTP_400_BAD_REQUEST,
                )
            form[name] = str(value)
        try:
            model, profile = build_model(form, settings.BYTES_URL)
            services.add_model(model, [profile], request.user.get_username())
        except ServeError as error:
            return Response({"field": error.field, "error": error.sentence}, status=status.HTTP_400_BAD_REQUEST)
        model = Model.objects.prefetch_related("profiles").get(pk=model.pk)
        return Response(ModelSerializer(model).data, status=status.HTTP_201_CREATED)
