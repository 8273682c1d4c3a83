"""vLLM across several nodes (issue 37): a Ray cluster over the group, then `vllm serve` on its head.

The commands are made in contracts/ray.py, which the agents that run them share with the control
plane; here for the control plane's callers. This cannot run here (no GPU):
tests/test_rpc_group_placement.py runs the commands against stand-ins, tests/test_vllm_group.py
a group on real agents.
"""

from __future__ import annotations

from contracts.ray import PIPELINE, RAY_PORT, TENSOR, Step, vllm_group_commands

__all__ = ["PIPELINE", "RAY_PORT", "TENSOR", "Step", "vllm_group_commands"]
