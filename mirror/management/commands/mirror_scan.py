from django.core.management.base import BaseCommand

from mirror import scan


class Command(BaseCommand):
    help = "Reconcile the mirror's index with the directory, and hash new or changed files."

    def add_arguments(self, parser):
        parser.add_argument("--no-hash", action="store_true", help="index only; leave hashing to the workers")

    def handle(self, *args, no_hash=False, **options):
        report = scan.scan_mirror()
        for line in report.added:
            self.stdout.write(f"added {line}")
        for line in report.changed:
            self.stdout.write(f"changed {line}")
        for line in report.removed:
            self.stdout.write(f"removed {line}")
        for sentence in report.skipped:
            self.stderr.write(f"skipped: {sentence}")
        if not no_hash:
            for file_id in report.to_hash:
                digest = scan.hash_file(file_id)
                if digest:
                    self.stdout.write(f"hashed {digest[:12]}… (file {file_id})")
        self.stdout.write(f"mirror {scan.disk.root()}: {report.summary()}")
