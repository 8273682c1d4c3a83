"""llmgw itself in a benchmark: Django in this process, or a tree run as an operator runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from .servers import ROOT, Servers, free_port


def django_setup(var: Path | None = None) -> None:
    """Django in this process on this tree's code; with `var`, on a SQLite database of its own there, migrated."""
    # First on the path: bench/ comes first otherwise, and its gateway.py would hide the gateway app.
    sys.path.insert(0, str(ROOT))
    os.environ["DJANGO_SETTINGS_MODULE"] = "llmgw_site.settings"
    if var is not None:
        os.environ["LLMGW_VAR"] = str(var)
        os.environ.pop("DATABASE_URL", None)
    os.chdir(ROOT)
    import django

    django.setup()
    if var is not None:
        from django.core.management import call_command

        call_command("migrate", verbosity=0)


# Each route: a model with a ready replica at each of its `endpoints`, on a node named bench. Only fields every
# tree since the gateway has, so that a --baseline tree takes the same seed.
ROUTES_SEED = """
import json
from catalog.models import Model, Profile
from fleet.models import Node, Replica
node, _ = Node.objects.get_or_create(name="bench")
for route in json.loads(ROUTES):
    model, _ = Model.objects.get_or_create(name=route["model"], defaults=route["model_fields"])
    Profile.objects.get_or_create(model=model, name="cpu", defaults=dict(engine="llamacpp", **route["profile_fields"]))
    for endpoint in route["endpoints"]:
        Replica.objects.update_or_create(
            model_name=route["model"], profile_name="cpu", node=node, endpoint=endpoint, defaults=dict(state="ready")
        )
"""


class Site:
    """An llmgw tree (this one, or --baseline's) with its own var/ and SQLite under the run's work
    directory, migrated; routes written ready and keys made with its own `manage.py`, its server
    started in `servers`. A tree without `manage.py gateway` serves /v1/ from `admin_server`, as
    llmgw did before the gateway had a process of its own: both listen on `port`."""

    def __init__(
        self,
        servers: Servers,
        name: str = "llmgw",
        root: Path | None = None,
        redis_port: int | None = None,
        **settings: str,
    ) -> None:
        self.servers, self.name, self.root = servers, name, root or ROOT
        self.port = free_port()
        work = servers.work / name
        work.mkdir()
        self.env = dict(
            os.environ,
            LLMGW_GATEWAY_ADDR=f"127.0.0.1:{self.port}",
            LLMGW_ADMIN_ADDR=f"127.0.0.1:{self.port}",
            LLMGW_VAR=str(work / "var"),
            DATABASE_URL=f"sqlite:///{work / 'bench.sqlite3'}",
            # Without a Redis nothing listens there, and it must not matter: a key without limits never asks Redis.
            REDIS_URL=f"redis://127.0.0.1:{redis_port or free_port()}/0",
        )
        self.env.update(settings)
        known = self.manage("help", "--commands").split()
        self.server = "gateway" if "gateway" in known else "admin_server" if "admin_server" in known else None
        if self.server is not None:
            self.manage("migrate", "-v", "0")

    def manage(self, *args: str, env: dict | None = None) -> str:
        """`manage.py ARGS` of this tree; its output, or a sentence and its errors' tail when it fails."""
        done = subprocess.run(
            [sys.executable, str(self.root / "manage.py"), *args],
            env=env or self.env,
            cwd=self.root,
            capture_output=True,
            text=True,
        )
        if done.returncode:
            raise SystemExit(f"{self.name}: manage.py {args[0]} failed:\n{done.stderr[-2000:]}")
        return done.stdout

    def shell(self, code: str) -> subprocess.CompletedProcess:
        """`manage.py shell -c CODE`, quietly (without a Redis the catalog's signals warn)."""
        argv = [sys.executable, str(self.root / "manage.py"), "shell", "-c", code]
        return subprocess.run(argv, env=self.env, cwd=self.root, capture_output=True, text=True)

    def route(self, routes: list[dict]) -> None:
        """Each of `routes` ({"model", "endpoints", "model_fields", "profile_fields"}) written with ready replicas."""
        written = self.shell(f"ROUTES = {json.dumps(json.dumps(routes))}\n" + ROUTES_SEED)
        if written.returncode:
            raise SystemExit(f"{self.name}: the routes could not be written:\n{written.stderr[-2000:]}")

    def create_key(self, name: str, *flags: str) -> str:
        """A new API key's secret (`manage.py api_key create NAME FLAGS`)."""
        return self.manage("api_key", "create", name, *flags).strip().splitlines()[-1].strip()

    def start(self, command: str | None = None, **settings: str):
        """The tree's server (`gateway`, or `admin_server` in an older tree) in the run's servers."""
        argv = [sys.executable, str(self.root / "manage.py"), command or self.server]
        return self.servers.spawn(
            argv, self.name if command is None else f"{self.name}-{command}", dict(self.env, **settings), self.root
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"


def stub_site(
    servers: Servers,
    stub_port: int,
    name: str = "llmgw",
    root: Path | None = None,
    redis_port: int | None = None,
    **settings,
) -> Site | None:
    """A Site routing the models `stub` and `stub-hold` to bench/stub_upstream.py; None, said, for a tree without a server."""
    site = Site(servers, name, root, redis_port, **settings)
    if site.server is None:
        print(f"{name}: this tree has no `manage.py gateway` nor `admin_server`: it is left out of this run.")
        return None
    site.route(
        [
            {
                "model": model,
                "endpoints": [f"http://127.0.0.1:{stub_port}/v1"],
                "model_fields": dict(
                    source=f"http://127.0.0.1:1/{model}/v1/stub.gguf", context_length=100000, max_output=0
                ),
                "profile_fields": {},
            }
            for model in ("stub", "stub-hold")
        ]
    )
    return site
