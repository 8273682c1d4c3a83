from pathlib import Path

import pytest

from .processes import start_byte_listener, start_celery_worker


@pytest.fixture
def mirror_root(settings, tmp_path) -> Path:
    root = tmp_path / "mirror"
    root.mkdir()
    settings.MIRROR_ROOT = root
    return root


def put(root: Path, model: str, version: str, files: dict[str, bytes]) -> Path:
    """Copy files into the mirror by hand, the way an operator does."""
    directory = root / model / version
    directory.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (directory / name).write_bytes(content)
    return directory


@pytest.fixture
def byte_listener(mirror_root, tmp_path, django_db_setup, django_db_blocker):
    """A real byte-listener process (gunicorn) serving this test's mirror root."""
    process, url = start_byte_listener(mirror_root, tmp_path)
    yield url
    process.stop()


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
