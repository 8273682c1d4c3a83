from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from accounts.models import Team, TeamMember
from gateway.models import ApiKey, Usage

from ..budgets import team_budgets


class BudgetSerializer(serializers.Serializer):
    name = serializers.CharField(help_text='What it counts, like "tokens per day".')
    limit = serializers.CharField(help_text="The budget; money as a decimal string.")
    used = serializers.CharField(allow_null=True, help_text="Used now; null when it cannot be read now.")
    left = serializers.CharField(allow_null=True, help_text="What is left now; null when it cannot be read now.")


class TeamBudgetsSerializer(serializers.ModelSerializer):
    models = serializers.ListField(source="model_names", child=serializers.CharField(), read_only=True)
    budgets = serializers.SerializerMethodField(help_text="The team's budgets that are set, with what is left now.")

    class Meta:
        model = Team
        fields = ["id", "name", "models", "budgets", "created"]

    @extend_schema_field(BudgetSerializer(many=True))
    def get_budgets(self, team):
        return [
            {"name": b.name, "limit": str(b.limit), "used": _text(b.used), "left": _text(b.left)}
            for b in team_budgets(team)
        ]


class TeamMemberSerializer(serializers.ModelSerializer):
    team = serializers.IntegerField(source="team_id", help_text="The team's id.")
    username = serializers.CharField(source="user.username", read_only=True)
    who = serializers.CharField(write_only=True, max_length=254, help_text="The person's username or email.")

    class Meta:
        model = TeamMember
        fields = ["id", "team", "username", "who", "role", "from_provider", "added"]
        read_only_fields = ["from_provider", "added"]


class PersonalKeySerializer(serializers.ModelSerializer):
    team = serializers.IntegerField(source="team_id", help_text="The id of one of your teams.")
    owner = serializers.CharField(source="owner.username", read_only=True, default=None, allow_null=True)
    models = serializers.ListField(
        source="model_names",
        child=serializers.CharField(max_length=200),
        required=False,
        max_length=1000,
        help_text="Fewer models than the team's; empty for all of the team's.",
    )

    class Meta:
        model = ApiKey
        fields = ["id", "name", "prefix", "team", "owner", "models", "active", "expires", "created", "last_used"]
        read_only_fields = ["prefix", "active", "created", "last_used"]


class NewPersonalKeySerializer(PersonalKeySerializer):
    """What making a key answers: the record and, this once, the key itself."""

    key = serializers.CharField(read_only=True, help_text="The key; shown in this answer only, never again.")

    class Meta(PersonalKeySerializer.Meta):
        fields = [*PersonalKeySerializer.Meta.fields, "key"]


class UsageRowSerializer(serializers.ModelSerializer):
    key = serializers.IntegerField(source="key_id", read_only=True)
    key_name = serializers.CharField(source="key.name", read_only=True)
    team = serializers.CharField(source="key.team.name", read_only=True, default=None, allow_null=True)
    person = serializers.CharField(source="key.owner.username", read_only=True, default=None, allow_null=True)
    model = serializers.CharField(source="model_name", read_only=True)

    class Meta:
        model = Usage
        fields = [
            "key",
            "key_name",
            "team",
            "person",
            "model",
            "day",
            "requests",
            "prompt_tokens",
            "completion_tokens",
            "cached_tokens",
            "spend",
        ]


def _text(value):
    return None if value is None else str(value)
