"""requirements/*.lock: every package a host installs, indirect ones too, pinned with its hashes (issue 41 item 13).

Made with pip-tools from requirements/<role>.txt (the command is in each lock's header).
This holds each lock to its list: a pin changed in a .txt and not locked again fails here.
"""

from __future__ import annotations

import re

import pytest

from .support.processes import BASE_DIR

REQUIREMENTS = BASE_DIR / "requirements"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([^\s;\\]+)")


def normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path) -> dict[str, str]:
    """{package: version} of a requirements file, following its -r includes."""
    found = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line.startswith("-r "):
            found.update(pins((path.parent / line[3:].strip()).resolve()))
        elif match := PIN.match(line):
            found[normal(match[1])] = match[2]
    return found


def locked(path) -> dict[str, tuple[str, int]]:
    """{package: (version, how many hashes)} of a lock file."""
    found, current = {}, None
    for line in path.read_text().splitlines():
        if match := PIN.match(line):
            current = normal(match[1])
            found[current] = (match[2], 0)
        elif line.strip().startswith("--hash=sha256:") and current:
            version, hashes = found[current]
            found[current] = (version, hashes + 1)
    return found


@pytest.mark.parametrize("role", ["control", "node", "dev"])
def test_each_lock_pins_its_lists_packages_at_the_same_version_and_every_package_with_a_hash(role):
    wanted = pins(REQUIREMENTS / f"{role}.txt")
    lock = locked(REQUIREMENTS / f"{role}.lock")
    assert {name: lock.get(name, ("missing", 0))[0] for name in wanted} == wanted, f"lock {role} again"
    assert len(lock) > len(wanted), "the indirect dependencies are locked too"
    assert [name for name, (_, hashes) in lock.items() if hashes == 0] == []
    text = (REQUIREMENTS / f"{role}.lock").read_text()
    assert "--find-links" not in text and "--index-url" not in text  # nothing of the machine it was made on
