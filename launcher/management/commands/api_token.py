from django.contrib.auth import get_user_model
from django.core.management.base import CommandError

from accounts import tokens
from common.audit import AuditedCommand
from common.permissions import OPERATORS, VIEWERS, reads_llmgw


class Command(AuditedCommand):  # changes it makes are written as this command's (docs/audit.md)
    help = (
        "Print a new API token for a staff user: shown this once (only its hash is kept), "
        "good for LLMGW_API_TOKEN_DAYS days; the user's earlier tokens work until they expire."
    )

    def add_arguments(self, parser):
        parser.add_argument("username")

    def handle(self, *args, username, **options):
        user = get_user_model().objects.filter(username=username).first()
        if user is None:
            raise CommandError(f"there is no user called {username}")
        if not user.is_staff:
            raise CommandError(f"{username} is not staff, and the API is for staff only")
        if not user.is_superuser and not reads_llmgw(user):
            # A token that can do nothing looks like a broken API to whoever holds it.
            self.stderr.write(
                f'{username} is staff but in neither "{VIEWERS}" nor "{OPERATORS}" and not a superuser, so the API '
                "answers this token 403 everywhere: put it in one of the groups in the admin, under Users "
                "(docs/roles.md)."
            )
        self.stdout.write(tokens.issue(user))
