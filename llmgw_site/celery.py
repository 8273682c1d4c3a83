import os

from contracts.celery_app import QuietCelery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")

app = QuietCelery("llmgw")
app.config_from_object("django.conf:settings", namespace="CELERY")
# The control plane's tasks; a node's are the node's own app's (agent/celery.py).
app.autodiscover_tasks()


@app.on_after_configure.connect
def _lease_settings(sender, **kwargs):
    # celery-redbeat looks for its Redis settings by their bare names (it does not see the CELERY_
    # namespace's) and otherwise warns, on every start, that it falls back to the broker's.
    sender.conf.update(
        redbeat_redis_url=sender.conf.first("redbeat_redis_url"),
        redbeat_redis_options=sender.conf.first("redbeat_redis_options"),
    )
