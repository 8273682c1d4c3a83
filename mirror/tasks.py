from celery import shared_task

from . import scan


@shared_task(name="mirror.scan", ignore_result=True)
def scan_task() -> str:
    report = scan.scan_mirror()
    for file_id in report.to_hash:
        hash_task.delay(file_id)
    return report.summary()


@shared_task(name="mirror.hash_file", ignore_result=True)
def hash_task(file_id: int) -> None:
    # Safe to run twice: a file already hashed, gone or changed is left alone.
    scan.hash_file(file_id)
