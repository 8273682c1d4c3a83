"""Files that hold a secret are made with their mode: no other user can read them at any moment."""

import json
import os
import stat
import subprocess
import sys

from .support.processes import BASE_DIR, process_env

# Loads the real settings under umask 022 and, at every audited call while they load, notes
# the mode of each file in the state directory: the moment between a write and a chmod is seen.
WATCH = """
import json, os, stat, sys
var = sys.argv[1]
seen = []
busy = False
def watch(event, args):
    global busy
    if busy:
        return
    busy = True
    try:
        for name in os.listdir(var):
            try:
                st = os.stat(os.path.join(var, name))
                if stat.S_ISREG(st.st_mode):
                    seen.append([event, name, st.st_mode & 0o777])
            except FileNotFoundError:
                pass
    finally:
        busy = False
sys.addaudithook(watch)
os.umask(0o022)
import django
from django.conf import settings
settings.SECRET_KEY
print(json.dumps({"seen": seen, "key": settings.SECRET_KEY}))
"""


def test_the_secret_key_made_here_is_never_readable_by_others_under_umask_022(tmp_path):
    env = process_env(LLMGW_VAR=str(tmp_path), DJANGO_SETTINGS_MODULE="llmgw_site.settings")
    env.pop("DJANGO_SECRET_KEY", None)
    done = subprocess.run(
        [sys.executable, "-c", WATCH, str(tmp_path)], cwd=BASE_DIR, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    key_file = tmp_path / "secret_key"
    assert key_file.read_text() == out["key"]
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert [name for _, name, _ in out["seen"] if name.endswith("secret_key")], "the watch saw the key being made"
    readable = [(event, name, oct(mode)) for event, name, mode in out["seen"] if mode & 0o077]
    assert readable == []
    # Nothing is left beside it.
    assert [name for name in os.listdir(tmp_path) if name.startswith(".secret_key")] == []


def test_a_second_start_keeps_the_key_the_first_one_made(tmp_path):
    env = process_env(LLMGW_VAR=str(tmp_path), DJANGO_SETTINGS_MODULE="llmgw_site.settings")
    env.pop("DJANGO_SECRET_KEY", None)
    keys = []
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-c", WATCH, str(tmp_path)],
            cwd=BASE_DIR,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        keys.append(json.loads(done.stdout.splitlines()[-1])["key"])
    assert keys[0] == keys[1] == (tmp_path / "secret_key").read_text()


ASK_HOST = """
import django
django.setup()
from django.test import RequestFactory
print(RequestFactory().get("/m/", HTTP_HOST="10.0.0.1:8001").get_host())
"""


def test_the_byte_listener_with_control_env_accepts_the_host_a_node_sends(tmp_path):
    # deploy/env/control.env as an operator fills it: the admin's name, the listener's address.
    env = process_env(
        LLMGW_VAR=str(tmp_path),
        LLMGW_ROLE="bytes",
        DJANGO_SETTINGS_MODULE="llmgw_site.settings",
        DJANGO_ALLOWED_HOSTS="llmgw.example.org",
        LLMGW_BYTES_ADDR="0.0.0.0:8001",
        LLMGW_BYTES_URL="http://10.0.0.1:8001/",
    )
    done = subprocess.run(
        [sys.executable, "-c", ASK_HOST], cwd=BASE_DIR, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "10.0.0.1:8001"
