from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import transaction
from rest_framework import serializers

from ..models import Model, Profile, RoutingProfile
from ..rules import routing_problem


class ProfileSerializer(serializers.ModelSerializer):
    class Meta:
        model = Profile
        fields = [
            "name",
            "engine",
            "args",
            "weight",
            "priority",
            "min_memory_gb",
            "node_selector",
            "gpus",
            "parallel",
            "nodes",
        ]

    def validate(self, attrs):
        _clean(Profile(**attrs))
        return attrs


class ModelSerializer(serializers.ModelSerializer):
    profiles = ProfileSerializer(many=True)

    class Meta:
        model = Model
        fields = [
            "id",
            "name",
            "description",
            "aliases",
            "source",
            "context_length",
            "max_output",
            "kind",
            "routing_profile",
            "scaling_min",
            "scaling_max",
            "target_load",
            "quiet_s",
            "idle_s",
            "priority",
            "price_input",
            "price_cached_input",
            "price_output",
            "profiles",
            "added_by",
            "added_at",
            "declared",
        ]
        read_only_fields = ["added_by", "added_at", "declared"]
        # The name's uniqueness is one of Model.clean's rules, which says it in
        # a sentence that also covers aliases.
        # The routing profile's refusal is the catalog's sentence, the one the configuration file says.
        extra_kwargs = {
            "name": {"validators": []},
            # A negative price would pay a team for its requests and lift its spend budget.
            "price_input": {"min_value": 0},
            "price_cached_input": {"min_value": 0},
            "price_output": {"min_value": 0},
            "routing_profile": {
                "error_messages": {"invalid_choice": routing_problem("{input}", RoutingProfile.choices)}
            },
        }

    def validate_profiles(self, profiles):
        if not profiles:
            raise serializers.ValidationError("a model needs at least one profile")
        names = [p["name"] for p in profiles]
        if len(set(names)) != len(names):
            raise serializers.ValidationError("two profiles have the same name")
        return profiles

    def validate(self, attrs):
        fields = {k: v for k, v in attrs.items() if k != "profiles"}
        candidate = Model(**{**self._current_fields(), **fields})
        if self.instance is not None:
            candidate.pk = self.instance.pk
        _clean(candidate)
        return attrs

    def _current_fields(self) -> dict:
        if self.instance is None:
            return {}
        return {f.name: getattr(self.instance, f.name) for f in Model._meta.concrete_fields if f.name != "id"}

    @transaction.atomic
    def create(self, validated_data):
        profiles = validated_data.pop("profiles")
        model = Model.objects.create(**validated_data)
        for p in profiles:
            Profile.objects.create(model=model, **p)  # each saved: bulk_create tells the audit log nothing
        return model

    @transaction.atomic
    def update(self, instance, validated_data):
        profiles = validated_data.pop("profiles", None)
        model = super().update(instance, validated_data)
        if profiles is not None:
            model.profiles.all().delete()
            for p in profiles:
                Profile.objects.create(model=model, **p)
        return model


def _clean(instance) -> None:
    """Run the model's own rules, so the API says what the admin and the serve page say."""
    try:
        instance.clean()
    except DjangoValidationError as error:
        raise serializers.ValidationError(error.message_dict) from None
