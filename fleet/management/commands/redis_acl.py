from django.core.management.base import CommandError

from common.audit import AuditedCommand
from fleet import redis_acl


class Command(AuditedCommand):  # changes it makes are written as this command's (docs/audit.md)
    help = (
        "Print Redis's ACL file for llmgw: each principal its own user (docs/fleet.md, 'Redis users'). "
        "With --url USER, print the REDIS_URL to give that process instead."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--gateway", action="append", default=[], metavar="NAME", help="a gateway host's name (repeat for each)"
        )
        parser.add_argument(
            "--url",
            metavar="USER",
            help=f"print REDIS_URL for {redis_acl.CONTROL_USER}, {redis_acl.BYTES_USER} or {redis_acl.GATEWAY_PREFIX}NAME",
        )

    def handle(self, *args, gateway, url=None, **options):
        if url is not None:
            known = (redis_acl.CONTROL_USER, redis_acl.BYTES_USER)
            if url not in known and not (
                url.startswith(redis_acl.GATEWAY_PREFIX) and len(url) > len(redis_acl.GATEWAY_PREFIX)
            ):
                raise CommandError(
                    f"--url takes {redis_acl.CONTROL_USER}, {redis_acl.BYTES_USER} or {redis_acl.GATEWAY_PREFIX}NAME, "
                    f"not {url!r}; a node makes its own from its token (LLMGW_REDIS_ACL=true)"
                )
            self.stdout.write(redis_acl.url_for(url))
            return
        self.stdout.write(redis_acl.acl_file(gateway), ending="")
