"""/api/gateway/prompt-cache/: the prompt cache's hit rate per model, as the admin's front page shows it."""

from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from common.permissions import requires

from .. import overview


class PromptCacheRowSerializer(serializers.Serializer):
    model = serializers.CharField()
    prompt = serializers.IntegerField(help_text="Prompt tokens in the last 24 hours.")
    cached = serializers.IntegerField(help_text="Of them, those the engines took from their prompt cache.")
    percent = serializers.IntegerField(help_text="The hit rate: cached of prompt, percent, rounded.")


class PromptCacheSerializer(serializers.Serializer):
    models = PromptCacheRowSerializer(
        many=True, help_text=f"The {overview.MODELS_DRAWN} models with the most prompt tokens, most first."
    )


class PromptCacheView(APIView):
    """The prompt cache's hit rate per model over the last 24 hours (the overview's "Prompt cache" table)."""

    permission_classes = [requires("gateway.view_usage")]

    @extend_schema(responses=PromptCacheSerializer)
    def get(self, request):
        return Response(PromptCacheSerializer({"models": overview.last_24_hours()["prompt_cache"]}).data)
