from celery import shared_task

from . import audit


@shared_task(name="common.prune_audit", ignore_result=True)
def prune_audit() -> int:
    """The beat's daily "audit-prune": entries past LLMGW_AUDIT_DAYS go."""
    return audit.prune()
