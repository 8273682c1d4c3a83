import os
import socket
import subprocess
import sys

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import CommandError

from common.audit import AuditedCommand
from common.metrics import fresh_multiprocess_dir
from contracts.env import NODE_VARIABLES
from fleet import redis_acl
from fleet.enrolment import issue_token, token_hash_of
from fleet.live import redis_client
from launcher import services

# The one gateway `make run` starts, as its Redis user names it.
LOCAL_GATEWAY = "local"
# What a process needs of the machine it runs on, beside its settings.
MACHINE = ("PATH", "HOME", "LANG", "TMPDIR", "USER", "LOGNAME")


class Command(AuditedCommand):  # changes it makes are written as this command's (docs/audit.md)
    help = (
        "Run llmgw on this machine: Redis if needed, the admin server, the gateway, the byte listener and the workers."
    )

    def add_arguments(self, parser):
        parser.add_argument("--node", default=socket.gethostname().split(".")[0], help="this host's node name")

    def stop_engines(self, py: str, node: str) -> None:
        """The engines this host's agent started: they outlive the agent by design, not `make run`.

        Asked of the agent's own command, not imported: the launcher is control plane.
        """
        argv = [py, "manage.py", "agent", "--node", node, "--stop-engines"]
        subprocess.run(argv, cwd=settings.BASE_DIR, env=self.node_env(node))

    # The broker's address as a node is given it; with a private Redis, each process's own user.
    node_redis_url = ""
    redis_acl_on = False

    def node_env(self, node: str, token: str = "") -> dict[str, str]:
        """The agent's environment, a node's as deploy/env/node.env gives it: this host's broker,
        byte listener and var/, its token, and what of the node's variables the user set;
        nothing of the control plane's (no database, no Django settings module, no role)."""
        env = {name: os.environ[name] for name in (*MACHINE, *NODE_VARIABLES) if name in os.environ}
        env.update(
            LLMGW_NODE_NAME=node,
            REDIS_URL=self.node_redis_url or settings.REDIS_URL,
            LLMGW_BYTES_URL=settings.BYTES_URL,
            LLMGW_VAR=str(settings.VAR_DIR),
        )
        if token:
            env["LLMGW_NODE_TOKEN"] = token
        if self.redis_acl_on:
            env["LLMGW_REDIS_ACL"] = "true"
        return env

    def start_private_redis(self) -> object:
        """A redis-server of our own, each process of this host its own user (docs/fleet.md, "Redis users").

        The ACL file is written from the database (migrated first): the control plane, the byte
        listener, the local gateway and the nodes enrolled before; this host's node gets its
        user when its token is issued, as any node does. This process is the control plane.
        """
        call_command("migrate", interactive=False, verbosity=0)
        data_dir = settings.VAR_DIR / "redis"
        data_dir.mkdir(parents=True, exist_ok=True)
        aclfile = data_dir / "users.acl"
        redis_acl.write_acl_file(aclfile, [LOCAL_GATEWAY])
        plain = settings.REDIS_URL
        control = redis_acl.url_for(redis_acl.CONTROL_USER)
        process = services.start_private_redis(plain, data_dir, aclfile=aclfile, answers_url=control)
        self.node_redis_url, self.redis_acl_on = plain, True
        os.environ["REDIS_URL"] = settings.REDIS_URL = settings.CELERY_BROKER_URL = control
        os.environ["LLMGW_REDIS_ACL"] = "true"
        return process

    def handle(self, *args, node, **options):
        processes = services.ProcessGroup()
        note = self.prepare(processes)
        py = sys.executable
        # The control plane's processes count into one directory that /metrics adds up (docs/observability.md).
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(fresh_multiprocess_dir(settings.VAR_DIR / "metrics"))
        self.start_control_plane(processes, py, node)
        # This host enrols itself: a fresh token each start, handed straight to its agent, and
        # its engines on loopback (the agent's default LLMGW_ENGINE_HOST), where they are routed to.
        token = issue_token(node, address="127.0.0.1")
        if self.redis_acl_on and (problem := redis_acl.apply_node(redis_client(), node, token_hash_of(node) or "")):
            processes.stop()
            raise CommandError(problem)
        processes.start("agent", [py, "manage.py", "agent", "--node", node], env=self.node_env(node, token))
        self.say_where(note)
        sys.stdout.flush()
        code = processes.wait()
        self.stop_engines(py, node)
        self.stdout.write("llmgw stopped.")
        if code:
            raise CommandError("a service stopped unexpectedly; its output above says why")

    def prepare(self, processes: services.ProcessGroup) -> str | None:
        """Redis (a private one when none answers), the database migrated, the staff user and the demo
        models; the note on the staff user, if any. A problem stops what was started and says why."""
        services.private_database()
        try:
            services.check_addresses(
                {
                    "LLMGW_ADMIN_ADDR": settings.ADMIN_ADDR,
                    "LLMGW_GATEWAY_ADDR": settings.GATEWAY_ADDR,
                    "LLMGW_BYTES_ADDR": settings.BYTES_ADDR,
                }
            )
            if services.redis_answers(settings.REDIS_URL):
                self.stdout.write(f"Using the Redis at {settings.REDIS_URL}")
            else:
                self.stdout.write(f"Nothing answers at {settings.REDIS_URL}; starting a private redis-server.")
                processes.adopt("redis", self.start_private_redis())
            call_command("migrate", interactive=False, verbosity=0)
            note = services.ensure_staff_user()
            settings.MIRROR_ROOT.mkdir(parents=True, exist_ok=True)
            for demo in (services.ensure_demo_model(), services.ensure_real_demo_model()):
                if demo:
                    self.stdout.write(demo)
        except services.StartError as error:
            processes.stop()
            raise CommandError(str(error)) from None
        return note

    def start_control_plane(self, processes: services.ProcessGroup, py: str, node: str) -> None:
        """The admin server, the gateway, the byte listener, the workers and the scheduler."""
        processes.start("admin server", [py, "manage.py", "admin_server"])
        if self.redis_acl_on:
            gateway_url = redis_acl.url_for(redis_acl.gateway_user(LOCAL_GATEWAY))
            processes.start("gateway", [py, "manage.py", "gateway"], env=dict(os.environ, REDIS_URL=gateway_url))
            bytes_url = redis_acl.url_for(redis_acl.BYTES_USER)
            processes.start(
                "byte listener",
                [py, "manage.py", "byte_listener"],
                env=dict(os.environ, REDIS_URL=bytes_url, LLMGW_BYTES_REDIS_URL=bytes_url),
            )
        else:
            processes.start("gateway", [py, "manage.py", "gateway"])
            processes.start("byte listener", [py, "manage.py", "byte_listener"])
        processes.start("control worker", celery_worker(py, "control", node))
        # The scheduler, by the lease in Redis (deploy/systemd/llmgw-beat.service): one in the fleet however
        # many control hosts run one; this one waits for the lease while another host holds it.
        processes.start("scheduler", [py, "-m", "celery", "-A", "llmgw_site", "beat", "--loglevel", "INFO"])
        # Pulls from another mirror on slots of their own (deploy/systemd/llmgw-pulls.service): hours of one
        # never hold the control worker's placement.
        processes.start("pulls worker", celery_worker(py, "pulls", node))

    def say_where(self, note: str | None) -> None:
        """Where each part listens."""
        admin_host, admin_port = settings.ADMIN_ADDR
        self.stdout.write("")
        self.stdout.write("llmgw is up. Ctrl-C stops everything it started.")
        self.stdout.write(f"  admin:         http://{admin_host}:{admin_port}/admin/")
        self.stdout.write(f"  API:           http://{admin_host}:{admin_port}/api/  (schema at /api/schema/)")
        self.stdout.write(f"  gateway:       {settings.GATEWAY_URL}v1/  (keys: manage.py api_key create NAME)")
        self.stdout.write(f"  byte listener: {settings.BYTES_URL}")
        self.stdout.write(f"  mirror:        {settings.MIRROR_ROOT}  (copy files into <model>/<version>/)")
        if note:
            self.stdout.write(f"  {note}")


def celery_worker(py: str, queue: str, node: str) -> list[str]:
    """A Celery worker on one queue, named for it and this host, with two slots."""
    return [
        py,
        "-m",
        "celery",
        "-A",
        "llmgw_site",
        "worker",
        "-Q",
        queue,
        "-n",
        f"{queue}@{node}",
        "--concurrency",
        "2",
        "--loglevel",
        "INFO",
    ]
