import shutil
from pathlib import Path

import pytest

from .processes import start_byte_listener, start_celery_worker


@pytest.fixture(scope="session")
def django_db_setup(django_db_setup, django_db_blocker):
    """pytest-django's test database; on PostgreSQL, sessions left open are ended before it is dropped.

    A connection some thread of the test process opened (Django keeps one per thread), or a
    process a failed test left behind, would otherwise keep DROP DATABASE from running.
    """
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


def put(root: Path, model: str, version: str, files: dict[str, bytes]) -> Path:
    """Copy files into the mirror by hand, the way an operator does."""
    directory = root / model / version
    directory.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (directory / name).write_bytes(content)
    return directory


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

    from .gateway_process import start_gateway

    process, url = start_gateway(tmp_path)
    yield SimpleNamespace(url=url, process=process)
    process.stop()


@pytest.fixture
def redis_client():
    """The tests' Redis, as the control plane reaches it; llmgw's progress keys are gone after each test."""
    from fleet.live import redis_client

    client = redis_client()
    yield client
    for key in client.scan_iter("llmgw:*"):
        client.delete(key)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter):
    """The fleet test's one line when it could not run here (no root for `ip netns`), last, where it is seen."""
    yield
    for report in terminalreporter.stats.get("skipped", []):
        if "test_fleet_netns" in report.nodeid and isinstance(report.longrepr, tuple):
            terminalreporter.write_line(report.longrepr[2].removeprefix("Skipped: "), yellow=True, bold=True)
