from django.conf import settings
from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from catalog.api.serializers import ModelSerializer
from catalog.models import Model
from common.permissions import requires
from mirror.models import MirrorVersion

from .. import services
from ..forms import ServeForm


class ServePlanView(APIView):
    """What serving one mirrored version would mean: the serve page's pre-filled form, as JSON."""

    permission_classes = [requires("mirror.view_mirrorversion")]

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
    """Put a version into service: the serve page's form, for automation, with the same fields and sentences.

    A refusal is `{"field", "error"}`: the first problem in the order of the form.
    """

    # It adds a catalog model, as POST /api/catalog/models/ does.
    permission_classes = [requires("catalog.add_model", to_read=("mirror.view_mirrorversion",))]

    @extend_schema(
        request=inline_serializer(
            "ServeForm", {name: serializers.CharField(required=False) for name in ServeForm.base_fields}
        ),
        responses={201: ModelSerializer},
    )
    def post(self, request):
        data = request.data if isinstance(request.data, dict) else {}
        form = ServeForm(
            data={k: v for k, v in data.items() if k in ServeForm.base_fields}, byte_base=settings.BYTES_URL
        )
        model = form.save(added_by=request.user.get_username())
        if model is None:
            field, sentence = form.first_error()
            return Response({"field": field, "error": sentence}, status=status.HTTP_400_BAD_REQUEST)
        model = Model.objects.prefetch_related("profiles").get(pk=model.pk)
        # What the serve page says beside its saved message: a slot smaller than the context length.
        return Response(
            {**ModelSerializer(model).data, "warnings": [form.warning] if form.warning else []},
            status=status.HTTP_201_CREATED,
        )
