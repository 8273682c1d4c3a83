"""The test provider started in a process of its own, on a free loopback port, with an RSA key made here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from ...services import free_port
from ..processes import BASE_DIR, Process, wait_for_status

SETTINGS = "tests.support.oidc_provider.settings"


class Provider:
    """A running provider: `issuer`, `set(...)` its state, `stop()`."""

    def __init__(self, directory: Path) -> None:
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        key_file = directory / "provider-key.pem"
        key_file.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        key_file.chmod(0o600)
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.issuer = self.url + "/o"
        self.env = {
            "PATH": os.environ["PATH"],
            "HOME": os.environ.get("HOME", str(directory)),
            "PYTHONUNBUFFERED": "1",
            "DJANGO_SETTINGS_MODULE": SETTINGS,
            "PROVIDER_DB": str(directory / "provider.sqlite3"),
            "PROVIDER_RSA_KEY": str(key_file),
            "PROVIDER_ISSUER": self.issuer,
        }
        self.set(migrate=True)
        argv = [
            sys.executable,
            "-m",
            "gunicorn",
            "tests.support.oidc_provider.wsgi",
            "--bind",
            f"127.0.0.1:{port}",
            "--workers",
            "1",
            "--threads",
            "4",
        ]
        self.process = Process("oidc-provider", argv, self.env, directory)
        wait_for_status(self.process, self.issuer + "/.well-known/openid-configuration", 200, "the OIDC provider")

    def set(self, **state) -> None:
        """Its client, users and groups (management/commands/provider_state.py says the shape)."""
        done = subprocess.run(
            [sys.executable, "-m", "django", "provider_state", json.dumps(state)],
            cwd=BASE_DIR,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode:
            raise AssertionError(f"the provider's state was not set:\n{done.stderr}")

    def stop(self) -> None:
        self.process.stop()


def start_provider(directory: Path) -> Provider:
    """The provider running, its database migrated and empty of people."""
    return Provider(directory)
