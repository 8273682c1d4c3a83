import json

from django.core.management.base import BaseCommand

from fleet.status import fleet_status, table

COLUMNS = {
    "models": ["name", "kind", "replicas_ready", "replicas", "scaling"],
    "nodes": ["name", "state", "memory_gb", "gpus", "replicas", "agent_version", "last_heartbeat"],
    "replicas": ["id", "model", "profile", "node", "state", "endpoint", "reason"],
}


class Command(BaseCommand):
    help = "List the catalog's models, the nodes and the replicas, as a table or (--json) as JSON."

    def add_arguments(self, parser):
        parser.add_argument(
            "--json", dest="as_json", action="store_true", help="one JSON object: {models, nodes, replicas}"
        )

    def handle(self, *args, as_json: bool = False, **options):
        found = fleet_status()
        if as_json:
            self.stdout.write(json.dumps(found, indent=2))
            return
        for part, columns in COLUMNS.items():
            self.stdout.write(f"{part.capitalize()}:")
            for line in table(found[part], columns):
                self.stdout.write(line)
