from django.core.management.base import BaseCommand, CommandError
from django.db import connection, transaction

from gateway import grants


class Command(BaseCommand):
    help = (
        "Print the PostgreSQL statements that give ROLE (the gateways' database role) exactly what the gateway "
        "reads and writes, and nothing else; --apply runs them here. Run again after each upgrade's migrate."
    )

    def add_arguments(self, parser):
        parser.add_argument("role")
        parser.add_argument("--apply", action="store_true", help="run them on this database, as its owner")

    def handle(self, *args, role, apply, **options):
        if problem := grants.role_problem(role):
            raise CommandError(problem)
        said = grants.statements(role)
        if apply:
            if connection.vendor != "postgresql":
                raise CommandError(f"grants are PostgreSQL's; this database is {connection.vendor}")
            with transaction.atomic(), connection.cursor() as cursor:
                for statement in said:
                    cursor.execute(statement)
        self.stdout.write(";\n".join(said) + ";")
