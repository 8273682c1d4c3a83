from django.core.management.base import BaseCommand

from fleet.enrolment import issue_token


class Command(BaseCommand):
    help = "Print a new enrolment token for a node (made if new); its earlier token stops working."

    def add_arguments(self, parser):
        parser.add_argument("node")

    def handle(self, *args, node, **options):
        self.stdout.write(issue_token(node))
