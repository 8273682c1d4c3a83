import os

from django.conf import settings
from django.core.management.base import CommandError

from catalog.models import Model
from common import audit
from common.audit import AuditedCommand
from fleet import bench


def _levels(raw: str) -> list[int]:
    try:
        levels = [int(part) for part in raw.split(",") if part.strip()]
    except ValueError:
        raise CommandError(f"--levels is a list of whole numbers like 1,4,16, not {raw!r}") from None
    if not levels or min(levels) < 1:
        raise CommandError("--levels needs at least one concurrency of 1 or more")
    return levels


class Command(AuditedCommand):  # changes it makes are written as this command's (docs/audit.md)
    help = (
        "Send load through the gateway to MODEL's ready replica at 1, 4 and 16 concurrent requests, and record "
        "tokens per second, time to first token and memory at each on its profile (Fleet › Measured memory). "
        "The gateway's API key comes from --key or LLMGW_API_KEY."
    )

    def add_arguments(self, parser):
        parser.add_argument("model", help="the catalog name of the model to bench")
        parser.add_argument("--gateway", default="", help="the gateway's /v1/ address (default: this admin port's)")
        parser.add_argument("--key", default="", help="an API key for the gateway (default: $LLMGW_API_KEY)")
        parser.add_argument("--levels", default="1,4,16", help="concurrencies, comma-separated")
        parser.add_argument("--rounds", type=int, default=2, help="requests each client sends at each level")
        parser.add_argument("--max-tokens", type=int, default=32, help="the length of each answer")
        parser.add_argument(
            "--set-target-load",
            action="store_true",
            help="set the model's target load per replica to the concurrency the bench suggests",
        )

    def handle(self, *args, model, gateway, key, levels, rounds, max_tokens, set_target_load, **options):
        entry = Model.objects.filter(name=model).first()
        if entry is None:
            raise CommandError(f"there is no model called {model!r} in the catalog")
        key = key or os.environ.get("LLMGW_API_KEY", "")
        if not key:
            raise CommandError("the gateway needs an API key: --key KEY or LLMGW_API_KEY (manage.py api_key create)")
        url = gateway or f"http://{settings.ADMIN_ADDR}/v1"
        try:
            record = bench.run(
                model, url, key, _levels(levels), max(rounds, 1), max(max_tokens, 1), say=self.stdout.write
            )
        except bench.BenchError as error:
            raise CommandError(str(error)) from None
        suggested = record.bench["suggested_target_load"]
        self.stdout.write(f"Recorded on {record}. Suggested target load per replica: {suggested}.")
        if set_target_load:
            audit.record_update(entry, {"target_load": [entry.target_load, suggested]})  # update() is not heard
            Model.objects.filter(pk=entry.pk).update(target_load=suggested)
            self.stdout.write(f"The target load of {model} is now {suggested} (it was {entry.target_load}).")
