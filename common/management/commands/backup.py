from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from common.backup import BackupError, make_backup


class Command(BaseCommand):
    help = (
        "Write the control plane's state to ARCHIVE (mode 0600): the database and, when DJANGO_SECRET_KEY is not "
        "set, the key this host made. The mirror is files and is not copied (docs/running.md, Backup)."
    )

    def add_arguments(self, parser):
        parser.add_argument("archive", type=Path, help="the file to write; it must not exist")

    def handle(self, *args, archive: Path, **options):
        try:
            manifest = make_backup(archive)
        except BackupError as error:
            raise CommandError(str(error)) from None
        held = ", ".join(manifest["members"])
        self.stdout.write(f"{archive}: {held}, taken {manifest['made_at']}.")
        self.stdout.write(f"Not in it: {manifest['not_in_the_archive']['mirror']}.")
        if "not in the archive" in manifest["secret_key"]:
            self.stdout.write("Not in it: DJANGO_SECRET_KEY, which control.env holds; keep it with the backup.")
