from django.conf import settings
from django.core.management.base import CommandError

from common.audit import AuditedCommand
from contracts.names import node_name_problem
from fleet import enrolment, redis_acl
from fleet.live import redis_client
from fleet.models import Node


class Command(AuditedCommand):  # changes it makes are written as this command's (docs/audit.md)
    help = (
        "Print a fresh enrolment token for a node (created if new); its earlier token stops working. "
        "With --address, enrol where its engines answer (the gateway routes to nothing else). "
        "With --revoke, turn the node's token off and print nothing."
    )

    def add_arguments(self, parser):
        parser.add_argument("name", help="the node's name, as its agent is started with --node")
        parser.add_argument(
            "--revoke",
            action="store_true",
            help="turn the token off: the node's reports are ignored and the byte listener refuses it",
        )

        parser.add_argument(
            "--address",
            help=(
                "the IP address or host name the gateway reaches this node's engines at (its LLMGW_ENGINE_ADVERTISE); "
                "a replica reported anywhere else is refused. Left as it was when not given; a node never given "
                "one may have engines on 127.0.0.1 only"
            ),
        )

    def handle(self, *args, name, revoke=False, address=None, **options):
        if problem := node_name_problem(name.strip()):
            raise CommandError(problem)
        if revoke:
            if not enrolment.revoke_token(name.strip()):
                raise CommandError(f"there is no node called {name.strip()!r}")
            self.stderr.write(f"The token of node {name.strip()} is revoked.")
            self.redis_user(name.strip())
            return
        if address is not None and (problem := enrolment.address_problem(address.strip())):
            raise CommandError(f"--address: {problem}")
        token = enrolment.issue_token(name.strip(), address=None if address is None else address.strip())
        self.stdout.write(token)
        self.redis_user(name.strip())

    def redis_user(self, name: str) -> None:
        """With LLMGW_REDIS_ACL, the node's Redis user follows its token (fleet.redis_acl)."""
        if not settings.REDIS_ACL:
            return
        token_hash = Node.objects.filter(name=name).values_list("token_hash", flat=True).first() or ""
        if problem := redis_acl.apply_node(redis_client(), name, token_hash):
            self.stderr.write(problem[0].upper() + problem[1:] + ".")
