import os

from contracts.celery_app import QuietCelery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")

app = QuietCelery("llmgw")
app.config_from_object("django.conf:settings", namespace="CELERY")
# The control plane's tasks; a node's are the node's own app's (agent/celery.py).
app.autodiscover_tasks()
