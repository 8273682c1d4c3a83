"""Every catalog write, from wherever it comes, nudges placement once it is committed.

Here rather than in the catalog: the fleet reads the catalog, never the other way.
"""

import logging

from celery import current_app
from django.db import connection, transaction
from django.db.models.signals import post_delete, post_save
from django.dispatch import receiver

from catalog.models import Model, Profile
from contracts import tasks

log = logging.getLogger(__name__)


def send_reconcile() -> None:
    """Ask the control plane to place replicas for the catalog as it now is.

    A broker that is down never breaks a save: the catalog row is the record, and
    the next reconcile, whatever starts it, places from it.
    """
    try:
        current_app.send_task(tasks.RECONCILE, queue=tasks.CONTROL_QUEUE, retry_policy={"max_retries": 2})
    except Exception as error:  # any broker failure: the save itself succeeded
        log.warning("catalog saved, but fleet.reconcile could not be queued: %s", error)


def reconcile_after_commit() -> None:
    """Queue one fleet.reconcile once the current transaction commits (however many rows it wrote)."""
    # run_on_commit holds (savepoints, callback, robust) for what this transaction has queued so far.
    if not any(send_reconcile in queued for queued in connection.run_on_commit):
        transaction.on_commit(send_reconcile)


@receiver(post_save, sender=Model)
@receiver(post_delete, sender=Model)
@receiver(post_save, sender=Profile)
@receiver(post_delete, sender=Profile)
def catalog_changed(sender, **kwargs) -> None:
    reconcile_after_commit()
