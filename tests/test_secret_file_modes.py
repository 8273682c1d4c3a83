"""Every file llmgw writes that holds a secret is made 0600 from its first byte, under the usual umask 022.

Each test runs the code that writes the file in a process of its own under umask 022,
and where the file could be chmod-ed after it is made, watches its mode at every
audited call (a chmod is one): the moment between a write and a chmod is seen.
tests/test_secret_files.py does the same for var/secret_key.
"""

from __future__ import annotations

import json
import re
import stat
import subprocess
import sys

import pytest

from .services import free_port
from .support.processes import BASE_DIR, process_env

pytestmark = pytest.mark.django_db(transaction=True)

# The audit watch: every regular file under argv[1], its mode at each audited call.
WATCH = """
import json, os, stat, sys
watched = sys.argv[1]
seen = []
busy = False
def watch(event, args):
    global busy
    if busy:
        return
    busy = True
    try:
        for top, _, names in os.walk(watched):
            for name in names:
                try:
                    st = os.lstat(os.path.join(top, name))
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    seen.append([event, name, st.st_mode & 0o777])
    finally:
        busy = False
sys.addaudithook(watch)
os.umask(0o022)
import django
django.setup()
"""

# `make run`'s private Redis (launcher/management/commands/up.py): its users file as up
# writes it, then what Redis writes of its own: an ACL SAVE (a node's enrolment), its snapshot as it stops.
PRIVATE_REDIS = """
import redis
from django.conf import settings
from launcher.management.commands.up import Command
process = Command().start_private_redis()
try:
    client = redis.Redis.from_url(settings.REDIS_URL)
    client.execute_command("ACL", "SAVE")
    client.set("llmgw:test", "1")
finally:  # Redis saves its snapshot as it stops
    process.terminate()
    process.wait(30)
print(json.dumps(seen))
"""

# `make run`'s SQLite file (launcher/services.py private_database, the first thing `up` does),
# then a write in WAL mode, as the processes make it.
SQLITE = """
from django.db import connection
from launcher.services import private_database
private_database()
with connection.cursor() as cursor:
    cursor.execute("CREATE TABLE secrets (value text)")
    cursor.execute("INSERT INTO secrets VALUES ('a token hash')")
    print(json.dumps(seen + [["end", name, os.stat(os.path.join(watched, name)).st_mode & 0o777]
                             for name in os.listdir(watched) if name.startswith("llmgw.sqlite3")]))
"""


def run_watched(script: str, watched, **env) -> list[tuple[str, str, str]]:
    """(audited event, file name, mode) of every file under `watched` at each audited call of `script`."""
    environment = process_env(DJANGO_SETTINGS_MODULE="llmgw_site.settings", **env)
    for name, value in env.items():
        if value is None:
            environment.pop(name, None)
    done = subprocess.run(
        [sys.executable, "-c", WATCH + script, str(watched)],
        cwd=BASE_DIR,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [(event, name, oct(mode)) for event, name, mode in json.loads(done.stdout.splitlines()[-1])]


def test_make_runs_redis_users_file_and_what_redis_saves_are_never_readable_by_others(tmp_path):
    var = tmp_path / "var"
    seen = run_watched(PRIVATE_REDIS, var / "redis", LLMGW_VAR=str(var), REDIS_URL=f"redis://127.0.0.1:{free_port()}/0")
    assert {name for _, name, _ in seen} >= {"users.acl"}, seen
    readable = [(event, name, mode) for event, name, mode in seen if name != "redis.log" and int(mode, 8) & 0o077]
    assert readable == []
    for name in ("users.acl", "dump.rdb"):  # as Redis left them: its ACL SAVE made users.acl anew
        assert stat.S_IMODE((var / "redis" / name).stat().st_mode) == 0o600, name
    assert (var / "redis" / "users.acl").read_text().startswith("user default off")


def test_make_runs_sqlite_database_and_its_wal_are_never_readable_by_others(tmp_path):
    var = tmp_path / "var"
    seen = run_watched(SQLITE, var, LLMGW_VAR=str(var), DATABASE_URL=None)
    files = {name for _, name, _ in seen}
    assert {"llmgw.sqlite3", "llmgw.sqlite3-wal"} <= files, seen
    assert [entry for entry in seen if entry[1].startswith("llmgw.sqlite3") and entry[2] != "0o600"] == []


def test_the_users_file_made_as_fleet_md_says_is_never_readable_by_others(tmp_path):
    fleet = (BASE_DIR / "docs" / "fleet.md").read_text()
    line = next(line for line in fleet.splitlines() if "redis_acl --gateway" in line and "users.acl" in line)
    target = tmp_path / "users.acl"
    command = re.sub(r"\bllmgw-manage\b", f"{sys.executable} manage.py", line).replace(
        "/etc/redis/users.acl", str(target)
    )
    done = subprocess.run(
        ["sh", "-c", f"umask 022; {command}"],
        cwd=BASE_DIR,
        env=process_env(DJANGO_SETTINGS_MODULE="llmgw_site.settings"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert target.read_text().startswith("user default off")
    assert stat.S_IMODE(target.stat().st_mode) == 0o600, command
