import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")

app = Celery("llmgw")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
# Engines and replicas have their own task module in the agent app.
app.autodiscover_tasks(related_name="engine_tasks")
