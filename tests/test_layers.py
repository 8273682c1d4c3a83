"""The node side stands apart: a node loads the agent alone, with what requirements/node.txt installs."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CONTROL_ONLY = {
    "rest_framework",
    "drf_spectacular",
    "django_filters",
    "django_htmx",
    "dj_database_url",
    "psycopg",
    "uvicorn",
    "aiohttp",
    "a2wsgi",
    "whitenoise",
    "gunicorn",
    "mirror",
    "catalog",
    "fleet",
    "serving",
    "gateway",
    "launcher",
    "common",
}
# Not yaml: kombu loads it for a serializer of its own whenever it is installed.

PROBE = """
import os, sys
os.environ["LLMGW_ROLE"] = "node"
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")
import django
django.setup()
from django.core.management import load_command_class
load_command_class("agent", "agent")
load_command_class("agent", "fetch")
import agent.tasks, agent.engine_tasks, llmgw_site.celery
from django.conf import settings
print(",".join(sorted({m.split(".")[0] for m in sys.modules})))
print(",".join(settings.INSTALLED_APPS), len(settings.DATABASES))
"""


def test_a_node_loads_the_agent_and_no_control_plane_package_and_has_no_database():
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    loaded, (apps, databases) = set(done.stdout.splitlines()[0].split(",")), done.stdout.splitlines()[1].split()
    assert loaded & CONTROL_ONLY == set()
    assert (apps, databases) == ("agent", "0")


def test_manage_py_runs_the_node_commands_in_the_node_role():
    done = subprocess.run(
        [sys.executable, "manage.py", "agent", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and "--node" in done.stdout, done.stderr
