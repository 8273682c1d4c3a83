"""`manage.py fleet_status`: the catalog's models, the nodes and the replicas, as an operator runs it (issue 41 item 13)."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
from django.core.management import CommandError, call_command

from contracts.version import VERSION
from fleet.models import Node, Replica

from .support.factories import add_model, add_node, add_replica
from .support.processes import BASE_DIR, process_env

pytestmark = pytest.mark.django_db(transaction=True)


def manage(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "manage.py", *argv],
        cwd=BASE_DIR,
        env=process_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_fleet_status_lists_models_nodes_and_replicas_as_a_table_and_as_json():
    add_model("chat")
    add_model("idle")
    node = add_node("gpu-1", memory_gb=48)
    add_node("gpu-2", draining=True)
    Replica.objects.filter(pk=add_replica("chat", "http://10.0.0.21:8080/v1").pk).update(node=node)
    Replica.objects.filter(pk=add_replica("chat", state="pending", reason="no node has enrolled").pk).update(node=None)
    Node.objects.filter(name="n1").delete()  # add_replica's own node

    done = manage("fleet_status")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "Models:"
    rows = {line.split()[0]: line.split() for line in lines if line.startswith("  ") and "(none)" not in line}
    assert rows["chat"][:4] == ["chat", "chat", "1", "2"]  # kind, ready, all
    assert rows["idle"][2:4] == ["0", "0"]
    assert rows["gpu-1"][1:5] == ["ready", "48", "0", "1"]
    assert rows["gpu-2"][1] == "draining"
    assert "http://10.0.0.21:8080/v1" in done.stdout and "no node has enrolled" in done.stdout

    found = json.loads(manage("fleet_status", "--json").stdout)
    assert [m["name"] for m in found["models"]] == ["chat", "idle"]
    assert {n["name"]: n["state"] for n in found["nodes"]} == {"gpu-1": "ready", "gpu-2": "draining"}
    assert sorted((r["state"], r["node"]) for r in found["replicas"]) == [("pending", None), ("ready", "gpu-1")]


def command(*argv: str) -> tuple[str, str]:
    """A command run in this process (the subprocess above is the operator's way; this is the quick one)."""
    out, err = io.StringIO(), io.StringIO()
    call_command(*argv, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def test_an_empty_fleet_says_none_rather_than_nothing():
    assert command("fleet_status")[0].count("(none)") == 3


def test_manage_version_names_llmgws_release_from_pyproject():
    done = manage("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[:2] == ["llmgw", VERSION]
    assert VERSION.count(".") == 2 and VERSION != "0.1.0"


def test_a_node_is_removed_with_the_commands_docs_fleet_md_names():
    """Drained, then its token revoked with `node_token NAME --revoke`: its token proves nothing any more."""
    add_model("chat")
    node = add_node("old-node")
    token_hash = node.token_hash
    Node.objects.filter(pk=node.pk).update(draining=True)  # step 1, as the admin's checkbox does
    listed = json.loads(command("fleet_status", "--json")[0])
    assert [(n["name"], n["state"], n["replicas"]) for n in listed["nodes"]] == [("old-node", "draining", 0)]

    assert "The token of node old-node is revoked." in command("node_token", "old-node", "--revoke")[1]
    assert not Node.objects.filter(token_hash=token_hash).exists()
    with pytest.raises(CommandError, match="there is no node called 'no-such-node'"):
        command("node_token", "no-such-node", "--revoke")

    Node.objects.filter(pk=node.pk).delete()  # step 5, as the admin's delete does
    assert json.loads(command("fleet_status", "--json")[0])["nodes"] == []
