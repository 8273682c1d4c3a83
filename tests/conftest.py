"""The fixtures every test module may use; what they share that is not a fixture is in tests/support/.

Fixtures that start a process (a server, a worker, an agent, an engine) are named in
PROCESS_FIXTURES: a test that uses one, directly or through another fixture, is marked
`processes` and left out of `make test-fast` (docs/testing.md, "Which tier a test is in").
"""

import functools
import inspect
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from .support.processes import start_byte_listener, start_celery_worker

# Emptied by every flush, then made again row by row by post_migrate (create_contenttypes,
# create_permissions): about half of a `transactional_db` test's teardown. They hold no test's
# data, and post_migrate still makes any that are missing, so the tables are the same after.
KEPT_BY_FLUSH = {"django_content_type", "auth_permission"}


def _flush_keeping_types(style, connection, reset_sequences=True, allow_cascade=False):
    """django.core.management.sql.sql_flush, but leaving KEPT_BY_FLUSH's tables as they are."""
    tables = connection.introspection.django_table_names(only_existing=True, include_views=False)
    kept = [table for table in tables if table not in KEPT_BY_FLUSH]
    if connection.vendor == "postgresql" and not reset_sequences:
        # DELETE, not TRUNCATE: a test leaves a few rows, and TRUNCATE makes every table's and index's
        # files anew (a tenth of a second a flush). Django's foreign keys are checked at the commit
        # (DEFERRABLE INITIALLY DEFERRED), so the order of the tables does not matter.
        # The gateway's change triggers write gateway_tablechange on every DELETE: that table goes last,
        # so that the flush leaves it empty whatever order the tables came in (a set's).
        kept = sorted(kept, key=lambda table: (table == "gateway_tablechange", table))
        return [f"DELETE FROM {connection.ops.quote_name(table)};" for table in kept]
    return connection.ops.sql_flush(style, kept, reset_sequences=reset_sequences, allow_cascade=allow_cascade)


@pytest.fixture(scope="session")
def django_db_keepdb(request, django_db_modify_db_settings) -> bool:
    """Whether pytest-django keeps the test database: yes when it was made from the migrated template
    (tests/services.py, clone_migrated), which leaves it only the migrations newer than the template to run."""
    if request.config.getvalue("reuse_db"):
        return True
    from django.db import connection

    from .services import clone_migrated

    return connection.vendor == "postgresql" and clone_migrated(connection.creation._get_test_db_name())


@pytest.fixture(scope="session")
def django_db_setup(django_db_setup, django_db_blocker):
    """pytest-django's test database; on PostgreSQL, sessions left open are ended before it is dropped.

    A connection some thread of the test process opened (Django keeps one per thread), or a
    process a failed test left behind, would otherwise keep DROP DATABASE from running.

    The flush after each `transactional_db` test keeps the content types and permissions
    (`_flush_keeping_types`), and passwords are hashed with fewer rounds (tests/support/passwords.py).
    """
    from django.conf import settings
    from django.core.management.commands import flush
    from django.test.utils import override_settings

    flush.sql_flush = _flush_keeping_types
    # tests/support/passwords.py says why; the default stays second, so hashes it made still check.
    hashers = ["tests.support.passwords.FewRoundsPBKDF2PasswordHasher", *settings.PASSWORD_HASHERS]
    with override_settings(PASSWORD_HASHERS=hashers):
        yield
    from django.db import connection

    with django_db_blocker.unblock():
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )


@pytest.fixture(scope="session")
def shared_mirror_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mirror")


@pytest.fixture
def mirror_root(settings, shared_mirror_dir) -> Path:
    """An empty mirror for this test, the one the session's byte listener serves."""
    for child in shared_mirror_dir.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()
    settings.MIRROR_ROOT = shared_mirror_dir
    return shared_mirror_dir


@pytest.fixture(scope="session")
def byte_listener_process(shared_mirror_dir, tmp_path_factory, django_db_setup):
    process, url = start_byte_listener(shared_mirror_dir, tmp_path_factory.mktemp("byte-listener"))
    yield process, url
    process.stop()


@pytest.fixture
def fleet_node(transactional_db, monkeypatch) -> tuple[str, str]:
    """This test process as an enrolled node, (name, token): the byte listener serves only the fleet.

    Set where a node's agent and `manage.py fetch` read them, so fetches made here
    (and by processes started with the tests' environment) present the node's pass.
    """
    from fleet.enrolment import issue_token

    token = issue_token(TEST_NODE)
    monkeypatch.setenv("LLMGW_NODE_NAME", TEST_NODE)
    monkeypatch.setenv("LLMGW_NODE_TOKEN", token)
    return TEST_NODE, token


TEST_NODE = "fetcher"


@pytest.fixture
def byte_listener(mirror_root, byte_listener_process, fleet_node) -> str:
    """The address of a real byte-listener process (gunicorn) serving this test's mirror, to `fleet_node`."""
    process, url = byte_listener_process
    assert process.alive(), f"the byte listener died:\n{process.output()}"
    return url


@pytest.fixture
def control_worker(mirror_root, tmp_path, django_db_setup):
    """A real Celery worker on the control queue, against the test database."""
    process = start_celery_worker("control", "control", tmp_path, LLMGW_MIRROR_ROOT=mirror_root)
    yield process
    process.stop()


@pytest.fixture
def enrolled_node(transactional_db):
    """A node enrolled on the control plane: (name, token)."""
    from fleet.enrolment import issue_token

    return "n1", issue_token("n1")


@pytest.fixture
def agent_cache(tmp_path) -> Path:
    return tmp_path / "agent-cache"


@pytest.fixture
def gateway(transactional_db, tmp_path):
    """A real gateway process (`manage.py gateway`, uvicorn) on the test database: `.url` and `.process`."""
    from types import SimpleNamespace

    from .support.gateway_process import start_gateway

    process, url = start_gateway(tmp_path)
    yield SimpleNamespace(url=url, process=process)
    process.stop()


@pytest.fixture
def processes():
    """Processes started by a test (support/processes.py), stopped at its end whatever happened."""
    started = []
    yield started
    for process in started:
        process.stop()


@pytest.fixture
def redis_client():
    """The tests' Redis, as the control plane reaches it; llmgw's progress keys are gone after each test."""
    from fleet.live import redis_client

    client = redis_client()
    yield client
    for key in client.scan_iter("llmgw:*"):
        client.delete(key)


@pytest.fixture
def clean_redis():
    """The tests' Redis emptied before the test (every key, not only llmgw's progress keys)."""
    from fleet.live import redis_client

    redis_client().flushdb()


@pytest.fixture
def staff_client():
    """Django's test client logged in as "ann", a superuser."""
    from django.contrib.auth import get_user_model
    from django.test import Client

    client = Client()
    client.force_login(get_user_model().objects.create_superuser("ann", "", "a long password"))
    return client


@pytest.fixture
def replicas():
    """Make fake replicas (`replicas(name)`, real HTTP servers in this process); all stopped afterwards."""
    from .fake_replica import FakeReplica

    made = []

    def make(name: str = "fake") -> FakeReplica:
        made.append(FakeReplica(name))
        return made[-1]

    yield make
    for replica in made:
        replica.stop()


@pytest.fixture
def engine_cleanup(tmp_path):
    """Whatever engines a test leaves in its cache are stopped by their recorded pid."""
    from agent import engine_state, engines

    yield
    for cache in tmp_path.glob("cache*"):
        for entry in engine_state.read_state(cache)["replicas"].values():
            if entry.get("pid"):
                engines.stop_group(entry["pid"], grace=3)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    """The tiny three-file GGUF llama.cpp serves in the tests (launcher.demo_model)."""
    from launcher.demo_model import write_tiny_llama

    directory = tmp_path_factory.mktemp("weights")
    write_tiny_llama(directory)
    return directory


@pytest.fixture
def vllm_stand_in(tmp_path, monkeypatch) -> Path:
    """A `vllm` on PATH that records its arguments (tests/support/engines.py STAND_IN); the log's path."""
    from .support.engines import STAND_IN

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "vllm"
    script.write_text(STAND_IN.format(python=sys.executable))
    script.chmod(0o755)
    calls = tmp_path / "vllm-calls.jsonl"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("VLLM_STAND_IN_LOG", str(calls))
    return calls


@pytest.fixture
def broker():
    """The tests' Redis as Celery's broker, emptied before and after the test."""
    import redis
    from django.conf import settings

    client = redis.Redis.from_url(settings.REDIS_URL)
    client.flushdb()
    yield client
    client.flushdb()


@pytest.fixture
def api(live_server, settings):
    """A staff member's token session on pytest-django's live server (`api.base`), the byte listener at :8001."""
    from .staff_api import token_session

    settings.BYTES_URL = "http://127.0.0.1:8001/"
    session = token_session()
    session.base = live_server.url
    return session


@pytest.fixture
def cache(tmp_path) -> Path:
    """Where a fetch in this test keeps what it fetched."""
    return tmp_path / "cache"


@pytest.fixture
def demo_on(settings):
    settings.DEMO_MODEL = True


@pytest.fixture
def staff_page(live_server):
    """Chromium, logged in to the live server as staff."""
    from .staff_browser import chromium_page, log_in_as_staff

    with chromium_page() as page:
        log_in_as_staff(page, live_server)
        yield page


@pytest.fixture(scope="module")
def real_model_weights() -> Path:
    """The real model's GGUF (tests/real_model.py)."""
    from . import real_model

    return real_model.gguf()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """One real llama.cpp replica on the real model (tests/real_model.py), as the supervisor would start it, for
    a module's tests: its endpoint."""
    from agent import engines

    from . import real_model

    process, endpoint, _ = real_model.start_engine(real_model.gguf(), tmp_path_factory.mktemp("engine"))
    yield endpoint
    engines.stop_group(process.pid, grace=5)
    process.wait(timeout=10)


@pytest.fixture
def proxy(byte_listener, settings):
    """The byte listener behind a proxy that counts and misbehaves; the node is configured with it."""
    from .support.processes import CountingProxy

    counting = CountingProxy(byte_listener)
    settings.BYTES_URL = counting.url
    yield counting
    counting.stop()


@pytest.fixture
def agent_n1(tmp_path, mirror_root, byte_listener):
    """`manage.py agent --node n1`, enrolled with a token from the control plane, and nothing else."""
    from agent import engine_state, engines
    from fleet.enrolment import issue_token

    from .support.processes import Process, node_env

    token = issue_token("n1")
    cache = tmp_path / "cache-n1"
    env = node_env(LLMGW_NODE_TOKEN=token, LLMGW_HEARTBEAT_S=1, LLMGW_BYTES_URL=byte_listener)
    # The agent has no database: what it reports goes back through the broker.
    env["DATABASE_URL"] = "postgres://nobody@127.0.0.1:1/none"
    agent = Process(
        "agent-n1", [sys.executable, "manage.py", "agent", "--node", "n1", "--cache", str(cache)], env, tmp_path
    )
    yield agent, cache
    agent.stop()
    for entry in engine_state.read_state(cache)["replicas"].values():
        if entry.get("pid") and engines.group_alive(entry["pid"]):
            engines.stop_group(entry["pid"], grace=3)


# --- the two tiers ---------------------------------------------------------------------
#
# `make test` runs every test; `make test-fast` (LLMGW_TEST_TIER=fast, -m "not processes")
# only those that start no process. A test is marked `processes` here, at collection, when
# it or any fixture it uses (directly or through other fixtures) starts one: it uses a
# fixture of PROCESS_FIXTURES, carries a marker of PROCESS_MARKERS, or its code, or the
# code of a function of the tests it calls, names a process starter (PROCESS_STARTERS, or
# the `subprocess` module). So a new test lands in its tier by itself. Should one slip
# through, the fast tier fails it at its first process start with a sentence saying so.

PROCESS_FIXTURES = {
    "byte_listener_process",  # gunicorn
    "control_worker",  # a Celery worker
    "gateway",  # uvicorn
    "agent_n1",  # manage.py agent
    "engine_cleanup",  # the engines a supervisor starts
    "vllm_stand_in",  # vLLM's stand-in, started as an engine
}
PROCESS_MARKERS = {"browser", "engine"}
PROCESS_STARTERS = {
    "Process",
    "Popen",
    "CountingProxy",
    "AclRedis",
    "chromium_page",
    "Fleet",
    "Host",
    "build_fleet",
    "Supervisor",
}
PROCESS_MODULES = {"subprocess", "tests.fleet_netns", "tests.netns", "multiprocessing"}


def _starts_a_process(function, seen: set) -> bool:
    """Whether `function`'s code (its inner functions and lambdas too) names a process starter, or calls
    a function of the tests that does. A decorated one (a context manager) is read through to what it wraps,
    and a class of the tests by its methods (a server started in its __init__)."""
    if inspect.isclass(function):
        methods = [m for m in vars(function).values() if inspect.isfunction(m)]
        return any(_starts_a_process(method, seen) for method in methods)
    function = inspect.unwrap(function)
    code = getattr(function, "__code__", None)
    if code is None or code in seen:
        return False
    seen.add(code)
    namespace = getattr(function, "__globals__", {})
    codes = [code]
    while codes:
        current = codes.pop()
        codes.extend(c for c in current.co_consts if hasattr(c, "co_names"))
        for name in current.co_names:
            if name.startswith("start_") or name in PROCESS_STARTERS or name in PROCESS_MODULES:
                return True
            value = namespace.get(name)
            if getattr(value, "__name__", None) in PROCESS_MODULES:
                return True
            module = getattr(value, "__module__", "") or ""
            if module.startswith("tests.") and callable(value) and _starts_a_process(value, seen):
                return True
    return False


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "processes: starts a process (a server, a worker, an engine); not in make test-fast"
    )


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("processes"):
            continue
        info = getattr(item, "_fixtureinfo", None)
        names = set(info.names_closure) if info else set()
        seen: set = set()
        functions = [getattr(item, "function", None)]
        if info:
            for name in names:
                for definition in info.name2fixturedefs.get(name, ()):
                    module = getattr(definition.func, "__module__", "") or ""
                    if module.startswith("tests.") and definition.argname != "_the_fast_tier_starts_no_process":
                        functions.append(definition.func)
        if (
            names & PROCESS_FIXTURES
            or any(item.get_closest_marker(m) for m in PROCESS_MARKERS)
            or any(_starts_a_process(f, seen) for f in functions if f is not None)
        ):
            item.add_marker(pytest.mark.processes)
    # Last: a module that stops and starts the tests' PostgreSQL (tests/test_gateway_alone.py,
    # tests/test_database_away.py) leaves dead a connection opened before it in another context
    # of this process (Playwright's greenlet, a fixture's thread): "terminating connection due to
    # administrator command", then "the connection is closed", in every test after it that uses
    # that context. Run after everything else, such a module leaves no test behind it to break;
    # under pytest-xdist they are one unit of work, the last (pytest_xdist_make_scheduler).
    items.sort(key=lambda item: _stops_postgres(item.path))


@functools.cache
def _stops_postgres(module: Path) -> bool:
    """Whether a test module stops the tests' PostgreSQL, or ends every connection to its database: it
    names tests/support/gateway_process.py's stop_postgres, or drops the database WITH (FORCE) (a restore,
    tests/test_backup_restore.py). Read from its source, so pytest-xdist's controller, which imports no
    test, can tell."""
    if module.suffix != ".py":
        return False
    return re.search(r"\bstop_postgres\b|WITH \(FORCE\)", module.read_text()) is not None


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under `-n N --dist loadfile` (`make test`): a module's tests in one worker, as pytest-xdist's
    loadfile does, except that the modules that stop PostgreSQL are one unit, handed out last, so
    they are the last tests their worker runs (pytest_collection_modifyitems says why)."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LastUnitScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return "modules that stop PostgreSQL" if _stops_postgres(config.rootpath / scope) else scope

    return LastUnitScheduling(config, log)


_running = ["the session's setup"]  # the test whose setup, call or teardown runs now


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _running[0] = item.nodeid
    return (yield)


@pytest.fixture(scope="session", autouse=True)
def _the_fast_tier_starts_no_process():
    """In `make test-fast`, a test that starts a process after all fails with a sentence, not a slow run.

    Session-scoped, so that a process a module- or session-scoped fixture starts is refused too
    (a function-scoped guard is set up after them): the test it is refused in is named.
    """
    if os.environ.get("LLMGW_TEST_TIER") != "fast":
        yield
        return
    import subprocess

    started = subprocess.Popen.__init__

    def refuse(self, args, *a, **kw):
        # The one process the tier lets through: the mirror's header reader, which every scan
        # runs to read untrusted headers under limits (mirror/headers.py); a scan is in many
        # database tests, and the reader is a few tens of milliseconds.
        if isinstance(args, (list, tuple)) and any(str(arg).endswith("mirror/header_reader.py") for arg in args):
            return started(self, args, *a, **kw)
        raise AssertionError(
            f"{_running[0]} starts a process ({args!r}) in the fast tier: mark it "
            "@pytest.mark.processes, or name what starts it in tests/conftest.py's PROCESS_* sets"
        )

    subprocess.Popen.__init__ = refuse
    yield
    subprocess.Popen.__init__ = started


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter):
    """The fleet test's one line when it could not run here (no root for `ip netns`), last, where it is seen."""
    yield
    for report in terminalreporter.stats.get("skipped", []):
        if "test_fleet_netns" in report.nodeid and isinstance(report.longrepr, tuple):
            terminalreporter.write_line(report.longrepr[2].removeprefix("Skipped: "), yellow=True, bold=True)


@pytest.fixture(autouse=True)
def _no_swarm_outlives_its_test():
    """The libtorrent session a fetch made in this process (`agent.peers._local`) closed after the test.

    The agent keeps one for its life; in the tests' process it outlived the test that made it and
    went on announcing, as whichever node the next test's environment named, the sets of a cache
    that test never had (it vouched a stale manifest in Redis to that node's token).
    """
    yield
    from agent import peers

    with peers._local_lock:
        swarm, peers._local = peers._local, None
    if swarm is not None:
        swarm.close()


@pytest.fixture(autouse=True)
def _llmgws_celery_app_stays_current():
    """llmgw's Celery app is the current one again after each test.

    A Celery() made with its defaults becomes the process's current app, and every
    `shared_task` (the mirror's pull among them) is then sent through it: to its default
    queue "celery", with none of llmgw's routes. test_remote_control.py's attacker app did
    that, and the deploy test's pull, later in the same worker, waited on a queue no worker
    takes (2026-12-04).
    """
    yield
    from celery import current_app

    from llmgw_site.celery import app

    if current_app._get_current_object() is not app:
        app.set_current()
