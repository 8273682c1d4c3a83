from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from common.backup import BackupError, restore_backup


class Command(BaseCommand):
    help = (
        "Restore ARCHIVE (from `manage.py backup`) into this control plane's database, which must be empty "
        "unless --force. The whole archive is checked first and restored in one transaction: whole or not at all."
    )

    def add_arguments(self, parser):
        parser.add_argument("archive", type=Path, help="the file `manage.py backup` wrote")
        parser.add_argument(
            "--force", action="store_true", help="restore over a database that holds tables, replacing what they hold"
        )

    def handle(self, *args, archive: Path, force: bool, **options):
        try:
            restored = restore_backup(archive, force=force)
        except BackupError as error:
            raise CommandError(str(error)) from None
        self.stdout.write(
            f"Restored the {restored.database} database of {restored.made_at}. Start the control worker: "
            "nodes re-report what they run, replicas the backup knew are kept as they run, others are stopped."
        )
        for note in restored.notes:
            self.stdout.write(note)
