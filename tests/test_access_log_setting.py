"""The access logs' settings mean what they say: `false` turns a log off, `true` on.

`LLMGW_ACCESS_LOG=false` turned the byte listener's log on (any value did), and
`LLMGW_GATEWAY_ACCESS_LOG=false` wrote the gateway's into a file named "false".
Each is set on a real process (`manage.py byte_listener`, `manage.py gateway`).
"""

from __future__ import annotations

import pytest
import requests

from .support.gateway_process import start_gateway
from .support.processes import BASE_DIR, start_byte_listener
from .support.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_byte_listeners_access_log_is_off_with_false_and_on_with_true(tmp_path):
    for directory in ("mirror", "off", "on"):
        (tmp_path / directory).mkdir()
    off, off_url = start_byte_listener(tmp_path / "mirror", tmp_path / "off", LLMGW_ACCESS_LOG="false")
    on, on_url = start_byte_listener(tmp_path / "mirror", tmp_path / "on", LLMGW_ACCESS_LOG="true")
    try:
        requests.get(off_url + "probe-off", timeout=10)
        requests.get(on_url + "probe-on", timeout=10)
        # The one that logs has written its line; the other's, answered before it, would be there by now.
        # (Django's own warning names a 401's path either way; an access log line has the request's.)
        wait_until(lambda: '"GET /probe-on HTTP/1.1"' in on.output(), what="the byte listener's access log line")
        assert '"GET /probe-off HTTP/1.1"' not in off.output()
        assert '"GET / HTTP/1.1"' not in off.output()
    finally:
        off.stop()
        on.stop()


def test_the_gateways_access_log_set_to_false_is_off_not_a_file_named_false(tmp_path):
    process, url = start_gateway(tmp_path, LLMGW_GATEWAY_ACCESS_LOG="false")
    try:
        assert requests.get(url + "/v1/models", timeout=10).status_code == 401
        assert not (BASE_DIR / "false").exists()
        assert process.alive()
    finally:
        process.stop()
