"""The forms of /me/: a key of one's own, and a member of a team one runs."""

from __future__ import annotations

from datetime import datetime, time

from django import forms
from django.utils import timezone

from accounts.models import TeamMember

from . import access


class KeyForm(forms.Form):
    name = forms.CharField(max_length=100, help_text="Who or what uses this key: a laptop, a notebook, a service.")
    team = forms.TypedChoiceField(coerce=int, help_text="The team whose budgets the key counts against.")
    models = forms.CharField(
        required=False,
        max_length=2000,
        help_text="Fewer models than the team's, separated by commas; empty for all of the team's.",
    )
    expires = forms.DateField(
        required=False,
        widget=forms.DateInput(attrs={"type": "date"}),
        help_text="The key stops working at the start of this day; empty for never.",
    )

    def __init__(self, user, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["team"].choices = [(t.pk, t.name) for t in access.teams_of(user)]

    def model_names(self) -> list[str]:
        return [m.strip() for m in self.cleaned_data.get("models", "").split(",") if m.strip()]

    def expiry(self) -> datetime | None:
        day = self.cleaned_data.get("expires")
        return None if day is None else timezone.make_aware(datetime.combine(day, time.min))


class MemberForm(forms.Form):
    who = forms.CharField(max_length=254, label="Username or email")
    role = forms.ChoiceField(choices=TeamMember.Role.choices, initial=TeamMember.Role.MEMBER)
