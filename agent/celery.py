"""The node's Celery app: the agent's worker, configured from the node's settings (agent.settings).

It knows the agent's tasks alone (agent.tasks, agent.engine_tasks, agent.rpc_tasks); what a node sends
the control plane it sends by name (contracts.tasks), so it needs none of the control
plane's task modules, and the control plane's worker none of these.
"""

import os

from contracts.celery_app import QuietCelery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "agent.settings")

app = QuietCelery("llmgw-agent")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["agent"])
app.autodiscover_tasks(["agent"], related_name="engine_tasks")
app.autodiscover_tasks(["agent"], related_name="rpc_tasks")
