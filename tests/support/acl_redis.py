"""A redis-server of a test's own, run with llmgw's ACL file (fleet/redis_acl.py), as an operator runs it.

The session's Redis (tests/services.py) keeps its default user for the rest of the suite;
this one has `user default off`, a user per principal, and a `probe` user that only the
test uses, to load the file again and read `ACL LOG`.
"""

from __future__ import annotations

import secrets
import shutil
import subprocess
from pathlib import Path

import redis

from contracts import credentials
from fleet import redis_acl

from ..services import free_port
from .waiting import wait_until


class AclRedis:
    def __init__(self, work: Path, gateways: tuple[str, ...] = ("gw1",)):
        binary = shutil.which("redis-server")
        assert binary, "the tests need redis-server"
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.gateways = list(gateways)
        self.aclfile = work / "users.acl"
        self._probe_password = secrets.token_hex(16)
        self.write()
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
            + ["--dir", str(work), "--aclfile", str(self.aclfile)],
            stdout=open(work / "redis.log", "ab"),
            stderr=subprocess.STDOUT,
        )
        self.probe = redis.Redis.from_url(credentials.redis_url_as(self.url, "probe", self._probe_password))

        def answers():
            try:
                return self.probe.ping()
            except redis.ConnectionError:
                return False

        wait_until(
            answers, timeout=10, what=lambda: f"the ACL'd redis-server to answer\n{(work / 'redis.log').read_text()}"
        )
        self.probe.execute_command("ACL", "LOG", "RESET")

    def write(self) -> None:
        """The file `manage.py redis_acl` prints (for the nodes enrolled now), and the test's own user."""
        text = redis_acl.acl_file(self.gateways)
        self.aclfile.write_text(text + f"user probe on >{self._probe_password} ~* &* +@all\n")

    def reload(self) -> None:
        self.write()
        self.probe.execute_command("ACL", "LOAD")

    def url_of(self, user: str) -> str:
        """REDIS_URL for a control-plane-side principal (llmgw-control, llmgw-bytes, gateway-NAME)."""
        return credentials.redis_url_as(self.url, user, redis_acl.principal_password(user))

    def node_url(self, name: str, token_hash: str) -> str:
        return credentials.redis_url_as(
            self.url, credentials.redis_user(name), credentials.redis_password(token_hash, name)
        )

    def client(self, url: str) -> redis.Redis:
        return redis.Redis.from_url(url, socket_timeout=5)

    def denials(self) -> list[dict]:
        """ACL LOG: every command refused, as {'username', 'reason', 'object', ...}."""
        entries = self.probe.execute_command("ACL", "LOG", "128")
        out = []
        for entry in entries:
            if isinstance(entry, dict):
                out.append({_text(k): _text(v) for k, v in entry.items()})
            else:
                pairs = list(entry)
                out.append({_text(pairs[i]): _text(pairs[i + 1]) for i in range(0, len(pairs), 2)})
        return out

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=15)


def _text(value):
    return value.decode() if isinstance(value, bytes) else value
