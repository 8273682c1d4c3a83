from django.core.exceptions import ValidationError
from django_filters import rest_framework as filters
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.response import Response

from ..keys import create_key, describe_problem
from ..models import LIMIT_FIELDS, ApiKey, Usage
from .serializers import ApiKeySerializer, NewApiKeySerializer, UsageSerializer


class ApiKeyViewSet(mixins.CreateModelMixin, mixins.UpdateModelMixin, viewsets.ReadOnlyModelViewSet):
    """The gateway's API keys. POST makes one and answers the key once; PATCH sets `active`, `models` or limits.

    Limits (`requests_per_minute`, `tokens_per_minute`, `tokens_per_day`, `tokens_per_month`,
    `max_in_flight`) are null or 0 for none.

    There is no DELETE: a key is turned off (`active: false`) so its usage stays on the books.
    """

    queryset = ApiKey.objects.all()
    serializer_class = ApiKeySerializer
    http_method_names = ["get", "post", "patch", "head", "options"]

    @extend_schema(responses={201: NewApiKeySerializer})
    def create(self, request, *args, **kwargs):
        incoming = ApiKeySerializer(data=request.data)
        incoming.is_valid(raise_exception=True)
        name = incoming.validated_data["name"]
        try:
            key, secret = create_key(
                name,
                incoming.validated_data.get("model_names", []),
                created_by=request.user.get_username(),
                limits={f: incoming.validated_data.get(f) for f in LIMIT_FIELDS},
            )
        except ValidationError as error:
            raise serializers.ValidationError(describe_problem(error)) from None
        answer = NewApiKeySerializer(key).data
        answer["key"] = secret
        return Response(answer, status=status.HTTP_201_CREATED)

    def perform_update(self, serializer):
        key = serializer.save()
        try:
            key.full_clean()
        except ValidationError as error:
            raise serializers.ValidationError(describe_problem(error)) from None


class UsageFilter(filters.FilterSet):
    key = filters.CharFilter(field_name="key__name", help_text="a key's name")
    model = filters.CharFilter(field_name="model_name", help_text="a catalog model name")
    since = filters.DateFilter(field_name="day", lookup_expr="gte", help_text="the first day, YYYY-MM-DD")

    class Meta:
        model = Usage
        fields = ["key", "model", "since"]


class UsageViewSet(viewsets.ReadOnlyModelViewSet):
    """Requests and tokens per key, model and day, as the engines counted them."""

    serializer_class = UsageSerializer
    queryset = Usage.objects.select_related("key")
    filterset_class = UsageFilter
