from django.core.management.base import BaseCommand, CommandError

from contracts.names import node_name_problem
from fleet import enrolment


class Command(BaseCommand):
    help = (
        "Print a fresh enrolment token for a node (created if new); its earlier token stops working. "
        "With --revoke, turn the node's token off and print nothing."
    )

    def add_arguments(self, parser):
        parser.add_argument("name", help="the node's name, as its agent is started with --node")
        parser.add_argument(
            "--revoke",
            action="store_true",
            help="turn the token off: the node's reports are ignored and the byte listener refuses it",
        )

    def handle(self, *args, name, revoke=False, **options):
        if problem := node_name_problem(name.strip()):
            raise CommandError(problem)
        if revoke:
            if not enrolment.revoke_token(name.strip()):
                raise CommandError(f"there is no node called {name.strip()!r}")
            self.stderr.write(f"The token of node {name.strip()} is revoked.")
            return
        self.stdout.write(enrolment.issue_token(name.strip()))
