from django import forms
from django.contrib import admin
from django.contrib.auth import get_user_model

from .models import ApiToken, Team, TeamMember


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    """Staff see who holds which token and until when, and delete one to revoke it.

    A token is made by `manage.py api_token USERNAME`, which shows it once: the table
    keeps only its hash, so there is nothing here to show or edit.
    """

    list_display = ["prefix", "user", "created", "expires", "last_used"]
    list_filter = ["user"]
    search_fields = ["user__username", "prefix"]
    readonly_fields = ["user", "prefix", "created", "expires", "last_used"]
    exclude = ["key_hash"]

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False


class TeamMemberForm(forms.ModelForm):
    """A member named by username: operators manage teams without reading the accounts (auth.view_user),
    so a list of every person to pick from, or a raw id to look up, is not theirs to have."""

    user = forms.ModelChoiceField(
        queryset=get_user_model().objects.all(),
        to_field_name="username",
        label="person (username)",
        widget=forms.TextInput(attrs={"size": 24, "placeholder": "username"}),
        error_messages={
            "invalid_choice": "No one has the username %(value)s: a person signs in to llmgw once (with the "
            "provider, or a local account made for them) before they can join a team."
        },
    )

    class Meta:
        model = TeamMember
        fields = ["user", "role"]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.instance.pk:
            self.initial["user"] = self.instance.user.get_username()


class TeamMemberInline(admin.TabularInline):
    model = TeamMember
    form = TeamMemberForm
    fields = ["user", "role", "from_provider", "added"]
    readonly_fields = ["from_provider", "added"]
    extra = 0


@admin.register(Team)
class TeamAdmin(admin.ModelAdmin):
    """A team's models, budgets and members (docs/teams.md). A change reaches every gateway within a second:
    a member removed loses the keys they own for the team at once."""

    list_display = ["name", "models", "tokens_per_day", "tokens_per_month", "spend_per_month", "created"]
    search_fields = ["name"]
    readonly_fields = ["created"]
    fieldsets = [
        (None, {"fields": ["name", "model_names", "created"]}),
        (
            "Budgets shared by all the team's keys (blank for none; a day and a month in LLMGW_BUDGET_TIME_ZONE)",
            {
                "fields": [
                    ("requests_per_minute", "tokens_per_minute"),
                    ("tokens_per_day", "tokens_per_month"),
                    "spend_per_month",
                ]
            },
        ),
    ]
    inlines = [TeamMemberInline]

    @admin.display(description="models")
    def models(self, obj: Team) -> str:
        return ", ".join(obj.model_names) if obj.model_names else "every model"
