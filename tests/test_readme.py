"""The README's settings table names every setting the code reads."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
APPS = ["agent", "catalog", "common", "contracts", "fleet", "gateway", "launcher", "llmgw_site", "mirror", "serving"]
# Set by llmgw for its own processes, never by an operator.
INTERNAL = {"LLMGW_NODE_NAME", "LLMGW_NODE_LABELS", "LLMGW_TEST_DB"}
READ = re.compile(
    r"""(?:env_\w+\(|environ\.get\(|getenv\(|environ\[|[A-Z_]+ = )\s*"((?:LLMGW|DJANGO|REDIS|DATABASE)_?[A-Z_]*)\""""
)


def test_every_setting_the_code_reads_is_in_the_readmes_table():
    read = set()
    for app in APPS:
        for path in (ROOT / app).rglob("*.py"):
            read |= set(READ.findall(path.read_text()))
    read -= INTERNAL | {"DJANGO_SETTINGS_MODULE"}
    table = (ROOT / "README.md").read_text().split("## Settings", 1)[1].split("\n## ", 1)[0]
    missing = sorted(name for name in read if f"`{name}`" not in table)
    assert len(read) > 20 and missing == []
