from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from contracts.names import node_name_problem
from fleet import enrolment, redis_acl
from fleet.live import redis_client
from fleet.models import Node


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
            self.redis_user(name.strip())
            return
        self.stdout.write(enrolment.issue_token(name.strip()))
        self.redis_user(name.strip())

    def redis_user(self, name: str) -> None:
        """With LLMGW_REDIS_ACL, the node's Redis user follows its token (fleet.redis_acl)."""
        if not settings.REDIS_ACL:
            return
        token_hash = Node.objects.filter(name=name).values_list("token_hash", flat=True).first() or ""
        if problem := redis_acl.apply_node(redis_client(), name, token_hash):
            self.stderr.write(problem[0].upper() + problem[1:] + ".")
