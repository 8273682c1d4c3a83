from rest_framework import serializers

from ..models import LIMIT_FIELDS, ApiKey, Usage


class ApiKeySerializer(serializers.ModelSerializer):
    models = serializers.ListField(
        source="model_names",
        child=serializers.CharField(),
        required=False,
        help_text="Catalog model names the key may use; empty for every model.",
    )

    class Meta:
        model = ApiKey
        fields = ["id", "name", "prefix", "models", "active", *LIMIT_FIELDS, "created", "created_by", "last_used"]
        read_only_fields = ["prefix", "created", "created_by", "last_used"]


class NewApiKeySerializer(ApiKeySerializer):
    """What creating a key answers: the record and, this once, the key itself."""

    key = serializers.CharField(read_only=True, help_text="The key; shown in this answer only, never again.")

    class Meta(ApiKeySerializer.Meta):
        fields = [*ApiKeySerializer.Meta.fields, "key"]


class UsageSerializer(serializers.ModelSerializer):
    key = serializers.SlugRelatedField(slug_field="name", read_only=True)
    model = serializers.CharField(source="model_name", read_only=True)

    class Meta:
        model = Usage
        fields = ["key", "model", "day", "requests", "prompt_tokens", "completion_tokens"]
