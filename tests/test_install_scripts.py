"""What `make run` and `make test` install on a fresh Debian, and what they leave behind.

Each script runs as it is, with `apt-get` a stand-in on PATH that records what it is asked
(no package is installed and nothing leaves the machine); the test for what `make test`
leaves runs in a mount namespace of its own, so the host's /etc is not touched.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

BASE_DIR = Path(__file__).resolve().parents[1]

# apt-get as a stand-in: each call's arguments, and whether PostgreSQL's "no cluster" setting
# was there while it ran, one line each.
FAKE_APT_GET = """#!/bin/sh
printf '%s | %s\\n' "$*" "$(cat /etc/postgresql-common/createcluster.d/*.conf 2>/dev/null | tr '\\n' ' ')" >> {record}
"""


def fake_apt_get(tmp_path: Path) -> tuple[Path, Path]:
    """A directory holding the stand-in apt-get, and the file it records its calls in."""
    bin_dir, record = tmp_path / "bin", tmp_path / "apt-get.calls"
    bin_dir.mkdir()
    (bin_dir / "apt-get").write_text(FAKE_APT_GET.format(record=record))
    (bin_dir / "apt-get").chmod(0o755)
    return bin_dir, record


def test_make_run_on_a_debian_without_cmake_installs_it_before_the_engine_is_built(tmp_path):
    bin_dir, record = fake_apt_get(tmp_path)
    # A PATH with everything the script looks for but cmake: a fresh Debian with a compiler.
    for tool in ("sh", "id", "cat", "tr", "gcc", "g++", "make", "tar", "gzip", "sha256sum", "stunnel4", "stunnel"):
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    done = subprocess.run(
        ["sh", "scripts/ensure-engine-tools.sh"],
        cwd=BASE_DIR,
        env={"PATH": str(bin_dir), "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    calls = record.read_text().splitlines()
    assert [call.split(" | ")[0] for call in calls] == ["update -qq", "install -y -qq cmake"]
    # And `make run` reaches it: the engine, which `run` needs, runs it before a build.
    plan = subprocess.run(["make", "-n", "run"], cwd=BASE_DIR, capture_output=True, text=True, timeout=60).stdout
    assert plan.index("scripts/ensure-engine-tools.sh") < plan.index("sh scripts/build-engine.sh .venv/bin/python")


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="a mount namespace needs root")
def test_make_test_leaves_nothing_that_stops_apt_get_install_postgresql_making_its_cluster(tmp_path):
    bin_dir, record = fake_apt_get(tmp_path)
    # In a mount namespace: /etc/postgresql-common holds what an earlier `make test` left,
    # and PostgreSQL's server is hidden, so the script installs it (through the stand-in).
    script = f"""
set -e
mount -t tmpfs none /etc/postgresql-common
mkdir -p /etc/postgresql-common/createcluster.d
echo "create_main_cluster = false" > /etc/postgresql-common/createcluster.d/llmgw-tests.conf
mount -t tmpfs none /usr/lib/postgresql
PATH={bin_dir}:$PATH sh scripts/test-deps.sh
ls -A /etc/postgresql-common/createcluster.d
"""
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        cwd=BASE_DIR,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    install = [call for call in record.read_text().splitlines() if call.startswith("install")]
    assert len(install) == 1 and "postgresql" in install[0].split(" | ")[0], install
    # While the package installs, its own cluster is not made (the tests make theirs) ...
    assert "create_main_cluster = false" in install[0].split(" | ")[1]
    # ... and afterwards nothing is left that stops the next install making one.
    assert "llmgw-tests.conf" not in done.stdout
    assert "pg_createcluster --start" in done.stdout
