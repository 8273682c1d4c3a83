"""The node side stands apart: a node loads the agent alone, with what requirements/node.txt installs.

What the agent may import is written once, as the allow-list of pyproject.toml's import
contract for the node side (tests/import_allowlist.py); `make lint` checks the source
against it, and these tests check a running node against the same list.
"""

import json
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from contracts.env import NODE_VARIABLES

from .support.processes import env_file

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
NODE_CONTRACT = next(c for c in PYPROJECT["contracts"] if c["type"] == "allowlist" and c["source_modules"] == ["agent"])
ALLOWED = set(NODE_CONTRACT["allowed_modules"])
FIRST_PARTY = set(PYPROJECT["root_packages"])
# Loaded by a third-party package only if it happens to be installed, never needed, and
# installed here for the control plane: kombu registers a YAML serializer when PyYAML is
# there, and celery.utils.threads takes greenlet's getcurrent when greenlet is (gevent's);
# redis-py notes whether cryptography is there (for OCSP) and billiard uses cffi when it is
# (both come with mozilla-django-oidc, the control plane's sign-in).
OPTIONAL_EXTRAS = {"yaml", "greenlet", "cryptography", "cffi"}

# What `manage.py agent` loads before its worker runs a task, with the node's settings as
# manage.py chooses them, and the system checks Celery's Django fix-up runs at a worker's start.
PROBE = """
import os, sys
before = set(sys.modules)
os.environ["DJANGO_SETTINGS_MODULE"] = "agent.settings"
import django
django.setup()
from django.core.management import load_command_class
load_command_class("agent", "agent")
load_command_class("agent", "fetch")
import agent.tasks, agent.engine_tasks, agent.celery, agent.supervisor
agent.celery.app.loader.import_default_modules()
from django.core.checks import run_checks
problems = run_checks()
from django.conf import settings
import json
print(json.dumps({
    "loaded": sorted({m.split(".")[0] for m in set(sys.modules) - before}),
    "apps": list(settings.INSTALLED_APPS),
    "databases": len(settings.DATABASES),
    "urlconf": getattr(settings, "ROOT_URLCONF", None),
    "checks": [str(p) for p in problems],
    "tasks": sorted(t for t in agent.celery.app.tasks if not t.startswith("celery.")),
}))
"""


def node_requirements() -> set[str]:
    """The distributions a node installs: requirements/node.txt (and the engine's), with what they require."""
    wanted = []
    for path in (ROOT / "requirements" / "node.txt", ROOT / "requirements-engine.txt"):
        for line in path.read_text().splitlines():
            line = line.split("#")[0].strip()
            if line and not line.startswith("-"):
                wanted.append(Requirement(line).name)
    found: set[str] = set()
    while wanted:
        name = canonicalize_name(wanted.pop())
        if name in found:
            continue
        found.add(name)
        try:
            requires = metadata.distribution(name).requires or []
        except metadata.PackageNotFoundError:
            continue
        for raw in requires:
            requirement = Requirement(raw)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                wanted.append(requirement.name)
    return found


def probe() -> dict:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}  # a node's environment: nothing of this process's
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_a_node_loads_only_what_the_allow_list_and_node_txt_give_it_and_has_no_database():
    seen = probe()
    assert (seen["apps"], seen["databases"], seen["urlconf"]) == (["agent"], 0, None)
    assert seen["checks"] == []
    assert seen["tasks"] == [
        "agent.fetch",
        "agent.start_replica",
        "agent.start_rpc_worker",
        "agent.stop_replica",
        "agent.stop_rpc_worker",
    ]

    loaded = set(seen["loaded"])
    first_party = loaded & FIRST_PARTY
    assert first_party <= {"agent"} | ALLOWED, f"a node loaded {sorted(first_party - ALLOWED - {'agent'})}"
    providers = metadata.packages_distributions()
    installed = node_requirements()
    strangers = {
        name
        for name in loaded - FIRST_PARTY - set(sys.stdlib_module_names) - OPTIONAL_EXTRAS
        if name in providers and not {canonicalize_name(d) for d in providers[name]} & installed
    }
    assert strangers == set(), f"a node loaded {sorted(strangers)}, which requirements/node.txt does not install"


def test_the_allow_list_names_only_what_a_node_installs():
    providers = metadata.packages_distributions()
    installed = node_requirements()
    for name in ALLOWED - FIRST_PARTY:
        assert {canonicalize_name(d) for d in providers.get(name, [])} & installed, (
            f"{name} is in the node's allow-list, but requirements/node.txt does not install it"
        )
    assert "llmgw_site" not in ALLOWED and ALLOWED & FIRST_PARTY == {"contracts"}


def test_the_node_reads_the_variables_contracts_names_and_node_env_sets_only_those():
    settings_source = (ROOT / "agent" / "settings.py").read_text()
    read = set(re.findall(r'env_\w+\("([A-Z_]+)"', settings_source))
    agent_source = "\n".join(p.read_text() for p in (ROOT / "agent").rglob("*.py"))
    read |= set(re.findall(r'"(LLMGW_[A-Z_]+)"', agent_source)) - {"LLMGW_NODE_LABELS", "LLMGW_ENGINE_API_KEY"}
    assert read <= set(NODE_VARIABLES), f"the agent reads {sorted(read - set(NODE_VARIABLES))}, not in NODE_VARIABLES"
    assert set(env_file("node")) <= set(NODE_VARIABLES)


def test_manage_py_runs_the_node_commands_with_the_node_settings_whatever_the_environment_says():
    env = {"PATH": "/usr/bin:/bin", "DJANGO_SETTINGS_MODULE": "llmgw_site.settings", "LLMGW_ROLE": "control"}
    done = subprocess.run(
        [sys.executable, "manage.py", "agent", "--help"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and "--node" in done.stdout, done.stderr


def test_the_control_plane_has_no_node_app_and_no_node_role():
    from django.conf import settings

    assert "agent" not in settings.INSTALLED_APPS
    env = {"PATH": "/usr/bin:/bin", "LLMGW_ROLE": "node"}
    done = subprocess.run(
        [sys.executable, "manage.py", "check"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "a node runs with its own settings, agent.settings" in done.stderr
