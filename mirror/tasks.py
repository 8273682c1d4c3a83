import logging

from celery import shared_task

from common.locks import only_one

from . import pull, readiness, scan
from .models import MirrorFile

log = logging.getLogger(__name__)

SCAN_LOCK = "mirror-scan"


@shared_task(name="mirror.scan", ignore_result=True)
def scan_task() -> str:
    # One scan at a time across the control hosts: two at once walked the same mirror, raced to add
    # the same versions and each queued every new file's hashing.
    with only_one(SCAN_LOCK) as mine:
        if not mine:
            log.info("mirror scan skipped: another control worker is scanning the mirror now")
            return "skipped: another scan is under way"
        report = scan.scan_mirror()
        for file_id in report.to_hash:
            hash_task.delay(file_id)
        return report.summary()


@shared_task(name="mirror.hash_file", ignore_result=True)
def hash_task(file_id: int) -> None:
    # Safe to run twice: a file already hashed, gone or changed is left alone.
    scan.hash_file(file_id)
    # And when it was the version's last, the version's torrent (issue 24), computed once per content.
    row = MirrorFile.objects.filter(pk=file_id).values_list("version__model", "version__version").first()
    if row is not None:
        readiness.torrent_when_hashed(*row)


# On the pulls queue (CELERY_TASK_ROUTES), taken by llmgw-pulls alone: a pull may take hours, and on the
# control worker two would hold both its slots and stop placement (issue 34).
@shared_task(name="mirror.pull", ignore_result=True)
def pull_task(pull_id: int) -> None:
    # Safe to run twice: a pull done or failed is left alone, one of a version runs at a time, and a
    # second delivery of a pull under way leaves it to the first (mirror/pull.py, run).
    pull.run(pull_id)
