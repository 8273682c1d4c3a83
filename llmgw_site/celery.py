import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")

app = Celery("llmgw")
app.config_from_object("django.conf:settings", namespace="CELERY")
# The control plane's tasks; a node's are the node's own app's (agent/celery.py).
app.autodiscover_tasks()
