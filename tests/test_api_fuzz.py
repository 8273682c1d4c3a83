"""The API fuzzed from its own schema: Schemathesis finds no 500 and no answer that breaks the schema.

Status codes the schema does not list (a 400 or 404 on every route) are not checked: DRF's
error shapes are the same everywhere and drf-spectacular documents the successes.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .staff_api import token_session

pytestmark = pytest.mark.django_db(transaction=True)


def test_schemathesis_finds_no_server_error_and_no_answer_off_the_schema(live_server, tmp_path, settings):
    settings.BYTES_URL = "http://127.0.0.1:8001/"
    token = token_session("fuzzer").headers["Authorization"]
    st = Path(sys.executable).with_name("st")
    done = subprocess.run(
        [
            str(st),
            "run",
            f"{live_server.url}/api/schema/",
            "--header",
            f"Authorization: {token}",
            "--checks",
            "not_a_server_error,response_schema_conformance",
            "--phases",
            "examples,coverage,fuzzing",
            "--max-examples",
            "15",
            "--seed",
            "1",
            "--workers",
            "1",
            "--request-timeout",
            "30",
            "--max-time",
            "100",
        ],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=tmp_path,
        env={**os.environ, "SCHEMATHESIS_HOOKS": ""},
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
