from django.core.management.base import BaseCommand, CommandError

from contracts.names import node_name_problem
from fleet import enrolment


class Command(BaseCommand):
    help = "Print a fresh enrolment token for a node (created if new); its earlier token stops working."

    def add_arguments(self, parser):
        parser.add_argument("name", help="the node's name, as its agent is started with --node")

    def handle(self, *args, name, **options):
        if problem := node_name_problem(name.strip()):
            raise CommandError(problem)
        self.stdout.write(enrolment.issue_token(name.strip()))
