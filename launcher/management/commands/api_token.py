from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from rest_framework.authtoken.models import Token


class Command(BaseCommand):
    help = "Print the API token of a staff user, creating it if needed."

    def add_arguments(self, parser):
        parser.add_argument("username")

    def handle(self, *args, username, **options):
        user = get_user_model().objects.filter(username=username).first()
        if user is None:
            raise CommandError(f"there is no user called {username}")
        if not user.is_staff:
            raise CommandError(f"{username} is not staff, and the API is for staff only")
        token, _ = Token.objects.get_or_create(user=user)
        self.stdout.write(token.key)
