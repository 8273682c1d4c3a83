"""A wrong setting stops llmgw at start with a sentence naming it, not a traceback."""

import subprocess
import sys

import pytest

from .support.processes import BASE_DIR, node_env, process_env


@pytest.mark.parametrize(
    "name, value, sentence",
    [
        ("LLMGW_ADMIN_ADDR", "foo", "LLMGW_ADMIN_ADDR must be written HOST:PORT, like 127.0.0.1:8001, not 'foo'"),
        ("LLMGW_BYTES_ADDR", "127.0.0.1:99999", "LLMGW_BYTES_ADDR must be written HOST:PORT"),
        ("LLMGW_HEARTBEAT_S", "often", "LLMGW_HEARTBEAT_S must be a whole number, not 'often'"),
        ("LLMGW_SCAN_INTERVAL_S", "0", "LLMGW_SCAN_INTERVAL_S must be at least 1, not 0"),
        ("LLMGW_ALLOW_REMOTE_CODE", "maybe", "LLMGW_ALLOW_REMOTE_CODE must be true or false, not 'maybe'"),
        ("LLMGW_DEMO_MODEL", "please", "LLMGW_DEMO_MODEL must be true or false, not 'please'"),
        ("LLMGW_PREFIX_LOAD_BOUND", "lots", "LLMGW_PREFIX_LOAD_BOUND must be a number, like 1.25, not 'lots'"),
        ("LLMGW_PREFIX_LOAD_BOUND", "0.9", "LLMGW_PREFIX_LOAD_BOUND must be at least 1, not 0.9"),
        ("LLMGW_PREFIX_LOAD_BOUND", "nan", "LLMGW_PREFIX_LOAD_BOUND must be at least 1, not nan"),
    ],
)
def test_a_wrong_setting_is_one_sentence_and_a_failed_start(tmp_path, name, value, sentence):
    env = process_env(LLMGW_VAR=str(tmp_path), **{name: value})
    done = subprocess.run(
        [sys.executable, "manage.py", "check"], cwd=BASE_DIR, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0
    assert sentence in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "name, value, sentence",
    [
        ("LLMGW_HEARTBEAT_S", "often", "LLMGW_HEARTBEAT_S must be a whole number, not 'often'"),
        ("LLMGW_ALLOW_REMOTE_CODE", "maybe", "LLMGW_ALLOW_REMOTE_CODE must be true or false, not 'maybe'"),
        ("LLMGW_FETCH_PARALLEL", "0", "LLMGW_FETCH_PARALLEL must be at least 1, not 0"),
        ("LLMGW_FETCH_CONNECTIONS", "0", "LLMGW_FETCH_CONNECTIONS must be at least 1, not 0"),
        ("LLMGW_FETCH_CONNECTIONS", "many", "LLMGW_FETCH_CONNECTIONS must be a whole number, not 'many'"),
    ],
)
def test_a_wrong_node_setting_is_one_sentence_and_the_agent_does_not_start(tmp_path, name, value, sentence):
    env = node_env(LLMGW_NODE_TOKEN="llmgw-node-x", LLMGW_VAR=str(tmp_path), **{name: value})
    done = subprocess.run(
        [sys.executable, "manage.py", "agent", "--node", "n1"],
        cwd=BASE_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert done.stderr.strip() == f"llmgw cannot start: {sentence}"


def test_a_mirror_root_that_is_a_file_is_reported_by_the_system_check(tmp_path):
    not_a_directory = tmp_path / "mirror"
    not_a_directory.write_text("oops")
    env = process_env(LLMGW_VAR=str(tmp_path), LLMGW_MIRROR_ROOT=str(not_a_directory))
    done = subprocess.run(
        [sys.executable, "manage.py", "check"], cwd=BASE_DIR, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0
    assert "mirror.E001" in done.stderr and "which is a file, not a directory" in done.stderr
