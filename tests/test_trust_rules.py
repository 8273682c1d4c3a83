"""Issue 13, items 1c and 1d: a lock anyone can set in Redis does not stop placement, and engine
arguments are an allow-list on both sides."""

from __future__ import annotations

import logging

import pytest
from django.core.exceptions import ValidationError
from django.utils import timezone

from agent import engines
from agent.engine_tasks import start_on_node
from catalog import config
from catalog.models import Model, Profile
from contracts.engine_args import args_problem
from fleet import reconcile
from fleet.models import Node, Replica
from fleet.placement import ModelView, ProfileView

from .staff_api import token_session
from .support.engines import Reports

# --- 1c: the reconcile lock ------------------------------------------------------------------

TINY = [ModelView("tiny", "http://127.0.0.1:8001/tiny/v1/", 1, (ProfileView("cpu", "llamacpp", min_memory_gb=1),))]


@pytest.mark.django_db(transaction=True)
def test_a_reconcile_lock_set_by_hand_with_no_expiry_does_not_stop_placement(broker, caplog):
    Node.objects.create(name="a", engines=["llamacpp"], memory_gb=8, last_heartbeat=timezone.now())
    broker.set(reconcile.LOCK_NAME, "attacker")  # the SET, with no expiry
    with caplog.at_level(logging.WARNING, logger="fleet.reconcile"):
        plan = reconcile.reconcile(models=TINY)
    assert plan is not None
    assert Replica.objects.get().node.name == "a"
    assert "was held with no expiry" in caplog.text


@pytest.mark.django_db(transaction=True)
def test_a_reconcile_lock_set_by_hand_for_a_day_does_not_stop_placement(broker, caplog):
    Node.objects.create(name="a", engines=["llamacpp"], memory_gb=8, last_heartbeat=timezone.now())
    broker.set(reconcile.LOCK_NAME, "attacker", ex=86400)
    with caplog.at_level(logging.WARNING, logger="fleet.reconcile"):
        assert reconcile.reconcile(models=TINY) is not None
    assert "was held for 86400 s more" in caplog.text


@pytest.mark.django_db(transaction=True)
def test_a_pass_that_holds_the_lock_is_waited_for_not_broken(broker):
    held = broker.lock(reconcile.LOCK_NAME, timeout=reconcile.LOCK_TIMEOUT_S)
    assert held.acquire(blocking=False)
    assert reconcile.reconcile(models=TINY) is None
    assert broker.get(reconcile.LOCK_NAME) == held.local.token


@pytest.mark.django_db(transaction=True)
def test_a_pass_that_outlives_its_lock_says_so_in_the_log(broker, caplog, monkeypatch):
    real = reconcile.reconcile_unlocked

    def slow_pass(now, models=None, **kwargs):
        # As if the pass ran past the lock's expiry: the lock is gone when it finishes.
        broker.delete(reconcile.LOCK_NAME)
        return real(now, models, **kwargs)

    monkeypatch.setattr(reconcile, "reconcile_unlocked", slow_pass)
    with caplog.at_level(logging.WARNING, logger="fleet.reconcile"):
        reconcile.reconcile(models=TINY)
    assert f"longer than its lock's {reconcile.LOCK_TIMEOUT_S} s: the lock expired while it ran" in caplog.text


# --- 1d: engine arguments are an allow-list --------------------------------------------------

SMUGGLED = [
    ("vllm", ["--trust_remote_code"]),
    ("vllm", ["--trust-remote-cod"]),
    ("vllm", ["--config", "x.yaml"]),
    ("vllm", ["--max-model-len", "--trust-remote-code"]),
    ("vllm", ["--trust-remote-code"]),
    ("llamacpp", ["--trust-remote-code"]),
    ("llamacpp", ["--model", "/etc/passwd"]),
    ("llamacpp", ["--host", "0.0.0.0"]),
    ("llamacpp", ["--ctx-size", "512", "--port=80"]),
    ("llamacpp", ["8192"]),
]


@pytest.mark.parametrize("engine, args", SMUGGLED)
def test_an_argument_off_the_allow_list_is_refused_with_a_sentence(engine, args):
    problem = args_problem(engine, args)
    assert problem is not None
    assert any(arg.split("=")[0] in problem for arg in args), problem


@pytest.mark.parametrize(
    "engine, args",
    [
        ("llamacpp", ["--ctx-size", "8192", "--parallel", "2"]),
        ("llamacpp", ["-c", "4096", "-ngl", "-1", "--flash-attn", "on", "--jinja", "--alias", "x"]),
        ("llamacpp", ["--parallel", "4", "--slot-prompt-similarity", "0.5", "--metrics", "--reranking"]),
        ("vllm", ["--max-model-len", "16384", "--dtype", "half", "--gpu-memory-utilization=0.9"]),
        ("vllm", ["--tensor-parallel-size", "2", "--enable-prefix-caching", "--served-model-name", "m"]),
    ],
)
def test_the_arguments_the_docs_and_serve_page_write_are_allowed(engine, args):
    assert args_problem(engine, args) is None


def test_trust_remote_code_is_allowed_for_vllm_only_when_the_setting_says_so():
    assert "LLMGW_ALLOW_REMOTE_CODE" in args_problem("vllm", ["--trust-remote-code"])
    assert args_problem("vllm", ["--trust-remote-code"], allow_remote_code=True) is None
    assert args_problem("llamacpp", ["--trust-remote-code"], allow_remote_code=True) is not None


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("args", [["--trust_remote_code"], ["--trust-remote-cod"], ["--config", "x.yaml"]])
def test_the_api_refuses_a_smuggled_argument_and_stores_nothing(live_server, settings, args):
    settings.BYTES_URL = "http://127.0.0.1:8001/"
    api = token_session()
    r = api.post(
        live_server.url + "/api/catalog/models/",
        json={
            "name": "m",
            "source": "http://127.0.0.1:8001/m/v/",
            "context_length": 1024,
            "profiles": [{"name": "gpu", "engine": "vllm", "args": args}],
        },
    )
    assert r.status_code == 400, r.text
    assert "allow-list" in r.text
    assert not Model.objects.exists()


@pytest.mark.django_db
def test_the_admin_and_the_configuration_file_refuse_it_too(tmp_path):
    model = Model.objects.create(name="m", source="http://127.0.0.1:8001/m/v/", context_length=1)
    with pytest.raises(ValidationError) as refused:
        Profile(model=model, name="gpu", engine="vllm", args=["--trust_remote_code"]).clean()
    assert "allow-list" in str(refused.value)
    path = tmp_path / "catalog.yaml"
    path.write_text(
        "models:\n  - name: c\n    source: http://127.0.0.1:8001/c/v1/\n    context_length: 64\n"
        "    profiles:\n      - engine: vllm\n        args: ['--config', 'x.yaml']\n"
    )
    with pytest.raises(config.CatalogFileError, match="--config is not an argument llmgw gives vllm"):
        config.load(path)


@pytest.mark.parametrize("args", [["--trust_remote_code"], ["--trust-remote-cod"], ["--config", "x.yaml"]])
def test_the_node_refuses_a_smuggled_argument_before_fetching_or_starting(tmp_path, args):
    fetched, reports = [], Reports()
    ok = start_on_node(
        1, "http://mirror/m/v1/", "vllm", args, cache=tmp_path, fetch=lambda s, c: fetched.append(s), report=reports
    )
    assert not ok and fetched == []
    assert reports[-1][1] == "failed" and "allow-list" in reports[-1][3]
    with pytest.raises(engines.EngineError, match="allow-list"):
        engines.command("vllm", tmp_path, 9000, args, which=lambda name: "/usr/bin/vllm")
