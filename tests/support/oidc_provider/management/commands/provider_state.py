"""Set the provider's client, people and groups, as its operators would: `provider_state JSON`.

JSON: {"migrate": true, "client": {"client_id", "client_secret", "redirect_uri"},
"users": [{"username", "password", "email", "groups": [...], "active": true}]}; every part
optional. A user's groups become exactly those named; a missing group is made.
"""

import json

from django.contrib.auth.models import Group, User
from django.core.management import call_command
from django.core.management.base import BaseCommand
from oauth2_provider.models import Application


class Command(BaseCommand):
    def add_arguments(self, parser):
        parser.add_argument("state")

    def handle(self, *args, state: str, **options):
        state = json.loads(state)
        if state.get("migrate"):
            call_command("migrate", verbosity=0)
        if client := state.get("client"):
            Application.objects.filter(client_id=client["client_id"]).delete()
            Application.objects.create(
                name="llmgw",
                client_id=client["client_id"],
                client_secret=client["client_secret"],
                client_type=Application.CLIENT_CONFIDENTIAL,
                authorization_grant_type=Application.GRANT_AUTHORIZATION_CODE,
                redirect_uris=client["redirect_uri"],
                algorithm=Application.RS256_ALGORITHM,
                skip_authorization=False,
            )
        for person in state.get("users", []):
            user, _ = User.objects.get_or_create(username=person["username"])
            if "password" in person:
                user.set_password(person["password"])
            user.email = person.get("email", user.email)
            user.first_name = person.get("first_name", user.first_name)
            user.is_active = person.get("active", True)
            user.save()
            if "groups" in person:
                user.groups.set(Group.objects.get_or_create(name=name)[0] for name in person["groups"])
