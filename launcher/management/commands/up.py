import os
import socket
import sys

from django.conf import settings
from django.core.management import call_command, get_commands
from django.core.management.base import BaseCommand, CommandError

from launcher import services


class Command(BaseCommand):
    help = "Run llmgw on this machine: Redis if needed, the admin server, the byte listener and the workers."

    def add_arguments(self, parser):
        parser.add_argument("--node", default=socket.gethostname().split(".")[0], help="this host's node name")

    def stop_engines(self) -> None:
        """The engines this host's agent started: they outlive the agent by design, not `make run`."""
        try:
            from agent import engines
            from agent import supervisor as engine_supervisor
        except ImportError:
            return
        for replica_id, entry in engine_supervisor.read_state(settings.AGENT_CACHE)["replicas"].items():
            pid = entry.get("pid")
            if pid and engines.group_alive(pid):
                self.stdout.write(f"Stopping the engine of replica {replica_id} (pid {pid}).")
                engines.stop_group(pid, grace=10)

    def handle(self, *args, node, **options):
        supervisor = services.Supervisor(settings.VAR_DIR)
        try:
            services.check_addresses({"LLMGW_ADMIN_ADDR": settings.ADMIN_ADDR, "LLMGW_BYTES_ADDR": settings.BYTES_ADDR})
            if services.redis_answers(settings.REDIS_URL):
                self.stdout.write(f"Using the Redis at {settings.REDIS_URL}")
            else:
                self.stdout.write(f"Nothing answers at {settings.REDIS_URL}; starting a private redis-server.")
                supervisor.adopt("redis", services.start_private_redis(settings.REDIS_URL, settings.VAR_DIR / "redis"))
            call_command("migrate", interactive=False, verbosity=0)
            note = services.ensure_staff_user()
            settings.MIRROR_ROOT.mkdir(parents=True, exist_ok=True)
            for demo in (services.ensure_demo_model(), services.ensure_real_demo_model()):
                if demo:
                    self.stdout.write(demo)
        except services.StartError as error:
            supervisor.stop()
            raise CommandError(str(error)) from None

        py = services.python()
        admin_host, admin_port = settings.ADMIN_ADDR
        supervisor.start("admin server", [py, "manage.py", "admin_server"])
        supervisor.start("byte listener", [py, "manage.py", "byte_listener"])
        supervisor.start(
            "control worker",
            [
                py,
                "-m",
                "celery",
                "-A",
                "llmgw_site",
                "worker",
                "--beat",
                "-Q",
                "control",
                "-n",
                f"control@{node}",
                "--concurrency",
                "2",
                "--loglevel",
                "INFO",
                "--schedule",
                str(settings.VAR_DIR / "celerybeat-schedule"),
            ],
        )
        if "agent" in get_commands():
            # This host enrols itself: a fresh token each start, handed straight to its agent.
            from fleet.enrolment import issue_token

            agent_env = dict(os.environ, LLMGW_NODE_TOKEN=issue_token(node), LLMGW_NODE_NAME=node)
            supervisor.start("agent", [py, "manage.py", "agent", "--node", node], env=agent_env)

        self.stdout.write("")
        self.stdout.write("llmgw is up. Ctrl-C stops everything it started.")
        self.stdout.write(f"  admin:         http://{admin_host}:{admin_port}/admin/")
        self.stdout.write(f"  API:           http://{admin_host}:{admin_port}/api/  (schema at /api/schema/)")
        self.stdout.write(
            f"  gateway:       http://{admin_host}:{admin_port}/v1/  (keys: manage.py api_key create NAME)"
        )
        self.stdout.write(f"  byte listener: {settings.BYTES_URL}")
        self.stdout.write(f"  mirror:        {settings.MIRROR_ROOT}  (copy files into <model>/<version>/)")
        if note:
            self.stdout.write(f"  {note}")
        sys.stdout.flush()
        code = supervisor.wait()
        self.stop_engines()
        self.stdout.write("llmgw stopped.")
        if code:
            raise CommandError("a service stopped unexpectedly; its output above says why")
