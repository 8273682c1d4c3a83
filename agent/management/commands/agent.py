import json
import os
import time
from pathlib import Path

import redis
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from agent import engine_state, engines, facts, fence, metrics, peers, runtime, supervisor, worker
from agent.celery import app
from contracts import credentials
from contracts.names import node_name_problem
from contracts.tasks import node_queue

# How long a broker that does not answer yet is waited for at start (check_broker).
BROKER_WAIT_S = 30.0


class Command(BaseCommand):
    help = (
        "Run this host's agent: a Celery worker on queue node.NAME, with a heartbeat every LLMGW_HEARTBEAT_S "
        "seconds. Needs REDIS_URL, the byte listener's address and LLMGW_NODE_TOKEN; no database."
    )
    # A node has no database, and system checks must not go looking for one.
    requires_system_checks = []

    def add_arguments(self, parser):
        parser.add_argument("--node", required=True, help="this node's name, as enrolled on the control plane")
        parser.add_argument("--labels", default="", help="k=v,k2=v2: what profiles' node selectors match")
        parser.add_argument("--cache", type=Path, help="where fetched weights are kept; default LLMGW_AGENT_CACHE")
        parser.add_argument("--concurrency", type=int, default=2, help="tasks at once (fetches, engine tasks)")
        parser.add_argument("--loglevel", default="INFO")
        parser.add_argument(
            "--stop-engines",
            action="store_true",
            help="stop every engine this host's agent started, and exit; needs neither the token nor Redis",
        )

    def handle(self, *args, node, labels, cache=None, concurrency=2, loglevel="INFO", stop_engines=False, **options):
        fence.not_dumpable()  # its environment holds the broker's password and the node's token (agent.fence)
        if problem := node_name_problem(node):
            raise CommandError(problem)
        if stop_engines:
            self.stop_engines((cache or runtime.cache_dir()).resolve())
            return
        try:
            parsed_labels = facts.parse_labels(labels)
        except ValueError as error:
            raise CommandError(f"--labels: {error}") from None
        cache = self.made_cache(cache)
        token = self.token_of(node)
        worker.use_own_broker(app, node, token)
        self.check_broker()
        if problem := metrics.problem() or fence.engine_user_problem(settings.ENGINE_USER):
            raise CommandError(problem)

        # Where the tasks (and the pool's children, and the engine tasks) read who they are.
        os.environ[runtime.NODE_NAME] = node
        os.environ[runtime.AGENT_CACHE] = str(cache)
        os.environ[runtime.NODE_TOKEN] = token
        os.environ["LLMGW_NODE_LABELS"] = json.dumps(parsed_labels)

        supervisor.start()
        fence.drop_capabilities()  # the supervisor alone starts engines as LLMGW_ENGINE_USER
        # The node's one libtorrent session: fetches sets with the fleet, serves what it holds (agent/peers.py).
        if settings.FETCH_TORRENT:
            peers.start()
        if metrics.serve(node, cache):
            self.stdout.write(f"The node's metrics: http://{settings.AGENT_METRICS_ADDR}/metrics")
        worker.install(app)
        restored = worker.take_back_unacknowledged(app, node_queue(node))
        if restored:
            self.stdout.write(f"Took back {restored} task(s) an earlier run of this agent did not finish.")
        self.stdout.write(
            f"Agent for node {node}: queue {node_queue(node)}, cache {cache}, "
            f"heartbeat every {settings.HEARTBEAT_S} s, broker {credentials.redis_url_shown(settings.REDIS_URL)}"
        )
        self.stdout.flush()
        app.worker_main(worker_argv(node, concurrency, loglevel))

    def made_cache(self, cache: Path | None) -> Path:
        cache = (cache or runtime.cache_dir()).resolve()
        try:
            cache.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise CommandError(f"the cache {cache} cannot be made: {error.strerror}") from None
        return cache

    def token_of(self, node: str) -> str:
        """The node's enrolment token, or a CommandError saying where to get it."""
        token = runtime.token()
        if not token:
            # Never enrolled from a database here: a node has none. `make run`
            # makes this host's token and hands it over the same way.
            raise CommandError(
                "LLMGW_NODE_TOKEN is not set. A node needs the enrolment token the control plane made for it: "
                f"run `manage.py node_token {node}` on the control plane and set LLMGW_NODE_TOKEN to what it prints."
            )
        return token

    def stop_engines(self, cache: Path) -> None:
        """Engines outlive the agent by design; this is for whoever wants them gone too (`make run`'s end)."""
        for replica_id, pid in engine_state.running_engines(cache):
            self.stdout.write(f"Stopping the engine of replica {replica_id} (pid {pid}).")
            self.stdout.flush()
            try:
                engines.stop_group(pid, grace=10)
            except engines.EngineError as error:
                raise CommandError(str(error)) from None

    def check_broker(self) -> None:
        """The broker answers, or a CommandError; a broker not reachable yet is waited for, BROKER_WAIT_S at most.

        A host whose network has only just come up (a boot, a link restored) cannot reach
        the broker for its first seconds ("No route to host" while the neighbour is being
        resolved); an agent that gave up at once then never started where no service
        manager starts it again. A URL that cannot be parsed or a wrong password fails at once.
        """
        try:
            client = redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=3, socket_timeout=3)
        except ValueError as error:
            raise CommandError(
                f"nothing answers at REDIS_URL ({credentials.redis_url_shown(settings.REDIS_URL)}): {error}"
            ) from None
        deadline = time.monotonic() + BROKER_WAIT_S
        said = False
        while True:
            try:
                client.ping()
                return
            except (redis.ConnectionError, redis.TimeoutError, OSError) as error:
                if isinstance(error, redis.AuthenticationError) or time.monotonic() >= deadline:
                    raise CommandError(
                        f"nothing answers at REDIS_URL ({credentials.redis_url_shown(settings.REDIS_URL)}): {error}"
                    ) from None
                if not said:
                    self.stderr.write(f"Waiting up to {BROKER_WAIT_S:.0f} s for the broker at REDIS_URL: {error}")
                    said = True
                time.sleep(1.0)
            except redis.RedisError as error:
                raise CommandError(
                    f"nothing answers at REDIS_URL ({credentials.redis_url_shown(settings.REDIS_URL)}): {error}"
                ) from None


def worker_argv(node: str, concurrency: int, loglevel: str) -> list[str]:
    """The Celery worker's arguments: the node's own queue and nothing that talks on a fanout channel."""
    return [
        "worker",
        "--queues",
        node_queue(node),
        "--hostname",
        f"agent@{node}",
        "--concurrency",
        str(concurrency),
        "--pool",
        "prefork",
        "--loglevel",
        loglevel,
        # What contracts/celery_app.py forces anyway: no fanout channel a Redis client could speak on.
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
    ]
