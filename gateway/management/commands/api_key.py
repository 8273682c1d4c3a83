from django.core.exceptions import ValidationError
from django.core.management.base import CommandError

from common.audit import AuditedCommand
from gateway.keys import create_key, describe_problem
from gateway.models import LIMIT_FIELDS, ApiKey

# flag -> the key's field; 0 means no limit.
LIMIT_FLAGS = {
    "--rpm": ("requests_per_minute", "requests per minute"),
    "--tpm": ("tokens_per_minute", "tokens per minute"),
    "--tpd": ("tokens_per_day", "tokens per day"),
    "--tokens-per-month": ("tokens_per_month", "tokens per month"),
    "--in-flight": ("max_in_flight", "requests in flight at once"),
}


def add_limit_flags(parser) -> None:
    for flag, (field, what) in LIMIT_FLAGS.items():
        parser.add_argument(flag, type=int, dest=field, metavar="N", help=f"at most N {what}; 0 for no limit")


def limits_of(key: ApiKey) -> str:
    said = [f"{getattr(key, field)} {what}" for field, what in LIMIT_FLAGS.values() if getattr(key, field)]
    return ", ".join(said) or "no limits"


class Command(AuditedCommand):  # changes it makes are written as this command's (docs/audit.md)
    help = "Create, list or turn off the API keys clients send to the /v1/ gateway."

    def add_arguments(self, parser):
        actions = parser.add_subparsers(dest="action", required=True, metavar="{create,update,list,revoke}")
        create = actions.add_parser("create", help="make a key; it is printed once, on the last line")
        create.add_argument("name", help="who or what will use the key")
        create.add_argument(
            "--model", action="append", default=[], dest="models", help="a model the key may use (repeat); default: all"
        )
        add_limit_flags(create)
        update = actions.add_parser("update", help="change a key's limits (0 removes one)")
        update.add_argument("name")
        add_limit_flags(update)
        actions.add_parser("list", help="the keys, never the keys themselves")
        revoke = actions.add_parser("revoke", help="turn a key off; its usage is kept")
        revoke.add_argument("name")

    def handle(self, *args, action, **options):
        if action == "create":
            if ApiKey.objects.filter(name=options["name"].strip()).exists():
                raise CommandError(f"There is already a key named {options['name']!r}; choose another name.")
            try:
                key, secret = create_key(
                    options["name"],
                    options["models"],
                    created_by="manage.py api_key",
                    limits={field: options[field] for field in LIMIT_FIELDS if options[field] is not None},
                )
            except ValidationError as error:
                raise CommandError(describe_problem(error)) from None
            scope = ", ".join(key.model_names) if key.model_names else "every model"
            self.stderr.write(f"Key {key.name!r} made, for {scope}, {limits_of(key)}. It is shown this once; keep it:")
            self.stdout.write(secret)
        elif action == "update":
            key = ApiKey.objects.filter(name=options["name"]).first()
            if key is None:
                raise CommandError(f"There is no key named {options['name']!r}; 'manage.py api_key list' shows them.")
            changed = [field for field in LIMIT_FIELDS if options[field] is not None]
            if not changed:
                raise CommandError("Say which limit to change: " + ", ".join(LIMIT_FLAGS) + ".")
            for field in changed:
                setattr(key, field, options[field] or None)
            try:
                key.full_clean()
            except ValidationError as error:
                raise CommandError(describe_problem(error)) from None
            key.save(update_fields=changed)
            self.stdout.write(f"Key {key.name!r}: {limits_of(key)}; the gateway applies it within a second.")
        elif action == "list":
            for key in ApiKey.objects.all():
                scope = ", ".join(key.model_names) if key.model_names else "every model"
                state = "active" if key.active else "turned off"
                used = key.last_used.isoformat(timespec="seconds") if key.last_used else "never used"
                self.stdout.write(f"{key.name}\t{key.prefix}…\t{state}\t{scope}\t{limits_of(key)}\t{used}")
        elif action == "revoke":
            key = ApiKey.objects.filter(name=options["name"]).first()
            if key is None:
                raise CommandError(f"There is no key named {options['name']!r}; 'manage.py api_key list' shows them.")
            key.active = False
            key.save(update_fields=["active"])  # saved, not updated: the audit log hears of it
            self.stdout.write(f"Key {options['name']!r} is turned off; the gateway refuses it within a second.")
