"""The fleet deployed as docs/fleet.md and deploy/ say, by the steps an operator follows (issue 41)."""

from __future__ import annotations

import shutil

import pytest

from .netns import Fleet, unavailable
from .support import deploy

pytestmark = pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "")


@pytest.fixture(scope="module")
def fleet():
    made = Fleet()
    yield made
    made.remove()


@pytest.mark.skipif(shutil.which("nft") is None, reason="nft is not installed (scripts/test-deps.sh installs it)")
def test_the_control_hosts_firewall_keeps_loopback_replies_and_ssh_and_drops_the_rest(fleet):
    control, node, stranger = (fleet.add_host(label) for label in ("fw-control", "fw-node", "fw-stranger"))
    deploy.apply_firewall(control.name, deploy.firewall("control", {"10.0.0.21": node.address}))
    listeners = [
        deploy.listen(control.name, "127.0.0.1", 6379),  # Redis on the host's loopback
        deploy.listen(control.name, "0.0.0.0", 22),
        deploy.listen(control.name, "0.0.0.0", 8001),  # the byte listener, for nodes
        deploy.listen(control.name, "0.0.0.0", 8000),  # a port not listed
        deploy.listen(stranger.name, "0.0.0.0", 8000),  # somebody the control host calls
    ]
    try:
        assert deploy.connects(control.name, "127.0.0.1", 6379), "loopback is dropped"
        assert deploy.connects(control.name, stranger.address, 8000), "the reply to a connection it made is dropped"
        assert deploy.connects(stranger.name, control.address, 22), "SSH is dropped: the operator is locked out"
        assert deploy.connects(node.name, control.address, 8001)
        # and what is not listed is dropped, for a stranger and a node alike
        assert not deploy.connects(stranger.name, control.address, 8001, timeout=1)
        assert not deploy.connects(node.name, control.address, 8000, timeout=1)
    finally:
        for listener in listeners:
            listener.kill()
            listener.wait()
