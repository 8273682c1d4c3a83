"""Every setting is documented once: docs/settings.md names every setting the code reads, and the README points there."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
APPS = ["agent", "catalog", "common", "contracts", "fleet", "gateway", "launcher", "llmgw_site", "mirror", "serving"]
READ = re.compile(
    r"""(?:env_\w+\(|environ\.get\(|getenv\(|environ\[|[A-Z_]+ = )\s*"((?:LLMGW|DJANGO|REDIS|DATABASE)_?[A-Z_]*)\""""
)
# What the shell scripts and the deploy files read: ${LLMGW_X:-default}, $LLMGW_X.
SHELL_READ = re.compile(r"\$\{?((?:LLMGW|DJANGO|REDIS|DATABASE)_[A-Z_]*)")


def read_by_the_code() -> set[str]:
    read = set()
    for app in APPS:
        for path in (ROOT / app).rglob("*.py"):
            read |= set(READ.findall(path.read_text()))
    for path in [*(ROOT / "scripts").glob("*.sh"), ROOT / "deploy" / "llmgw-manage"]:
        read |= set(SHELL_READ.findall(path.read_text()))
    return read - {"DJANGO_SETTINGS_MODULE"}


def test_every_setting_the_code_reads_is_in_the_settings_reference():
    read = read_by_the_code()
    reference = (ROOT / "docs" / "settings.md").read_text()
    missing = sorted(name for name in read if f"`{name}`" not in reference)
    assert len(read) > 20 and missing == []


def test_the_readme_points_to_the_settings_reference_and_keeps_no_table_of_its_own():
    section = (ROOT / "README.md").read_text().split("## Settings", 1)[1].split("\n## ", 1)[0]
    assert "docs/settings.md" in section
    assert not [line for line in section.splitlines() if line.startswith("|")]


def test_each_setting_has_one_row_in_the_reference():
    rows = [line for line in (ROOT / "docs" / "settings.md").read_text().splitlines() if line.startswith("| `")]
    named = [name for row in rows for name in re.findall(r"`([A-Z_]+)`", row.split("|")[1])]
    assert len(named) == len(set(named)), sorted(n for n in named if named.count(n) > 1)


def test_every_test_the_failure_table_names_is_there():
    named = re.findall(r"`(test_\w+\.py)::(test_\w+)`", (ROOT / "docs" / "failures.md").read_text())
    missing = [f"{f}::{t}" for f, t in named if f"def {t}(" not in (ROOT / "tests" / f).read_text()]
    assert len(named) > 20 and missing == []
