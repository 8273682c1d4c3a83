from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from gateway.keys import create_key, describe_problem
from gateway.models import ApiKey


class Command(BaseCommand):
    help = "Create, list or turn off the API keys clients send to the /v1/ gateway."

    def add_arguments(self, parser):
        actions = parser.add_subparsers(dest="action", required=True, metavar="{create,list,revoke}")
        create = actions.add_parser("create", help="make a key; it is printed once, on the last line")
        create.add_argument("name", help="who or what will use the key")
        create.add_argument(
            "--model", action="append", default=[], dest="models", help="a model the key may use (repeat); default: all"
        )
        actions.add_parser("list", help="the keys, never the keys themselves")
        revoke = actions.add_parser("revoke", help="turn a key off; its usage is kept")
        revoke.add_argument("name")

    def handle(self, *args, action, **options):
        if action == "create":
            if ApiKey.objects.filter(name=options["name"].strip()).exists():
                raise CommandError(f"There is already a key named {options['name']!r}; choose another name.")
            try:
                key, secret = create_key(options["name"], options["models"], created_by="manage.py api_key")
            except ValidationError as error:
                raise CommandError(describe_problem(error)) from None
            scope = ", ".join(key.model_names) if key.model_names else "every model"
            self.stderr.write(f"Key {key.name!r} made, for {scope}. It is shown this once; keep it:")
            self.stdout.write(secret)
        elif action == "list":
            for key in ApiKey.objects.all():
                scope = ", ".join(key.model_names) if key.model_names else "every model"
                state = "active" if key.active else "turned off"
                used = key.last_used.isoformat(timespec="seconds") if key.last_used else "never used"
                self.stdout.write(f"{key.name}\t{key.prefix}…\t{state}\t{scope}\t{used}")
        elif action == "revoke":
            changed = ApiKey.objects.filter(name=options["name"]).update(active=False)
            if not changed:
                raise CommandError(f"There is no key named {options['name']!r}; 'manage.py api_key list' shows them.")
            self.stdout.write(f"Key {options['name']!r} is turned off; the gateway refuses it within a second.")
