"""vLLM across several nodes (issue 37): a Ray cluster over the group, then `vllm serve` on its head.

vLLM spreads one model over nodes through Ray: the head starts a Ray head, each worker joins it,
and `vllm serve` on the head runs with pipeline parallelism across the nodes (or tensor parallelism
across every GPU of the group). This cannot run here (no GPU); the commands and their order are
made by this pure function, and tests/test_rpc_group_placement.py runs them against stand-ins.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# Ray's default port for its head (GCS).
RAY_PORT = 6379
PIPELINE, TENSOR = "pipeline", "tensor"


@dataclass(frozen=True)
class Step:
    """One command on one node; the next step starts once this one has returned (Ray's) or answers (vLLM's)."""

    node: str
    argv: tuple[str, ...]


def vllm_group_commands(
    head: str,
    head_address: str,
    workers: Sequence[tuple[str, str]],
    target: str,
    port: int,
    served_name: str,
    gpus_per_node: int = 1,
    parallel: str = PIPELINE,
    args: Sequence[str] = (),
    ray_port: int = RAY_PORT,
) -> list[Step]:
    """The head's Ray head, each worker (name, address) joining it, then vllm serve on the head.

    Pipeline: the layers split across the nodes (`--pipeline-parallel-size` the node count), each
    node's GPUs in tensor parallel; the default, since it crosses the network once per token per
    stage rather than once per layer. Tensor: every GPU of the group in one tensor-parallel group.
    """
    if parallel not in (PIPELINE, TENSOR):
        raise ValueError(f"parallel is {parallel!r}, not {PIPELINE} or {TENSOR}")
    nodes = 1 + len(workers)
    steps = [Step(head, ("ray", "start", "--head", f"--port={ray_port}", f"--node-ip-address={head_address}"))]
    steps += [
        Step(name, ("ray", "start", f"--address={head_address}:{ray_port}", f"--node-ip-address={address}"))
        for name, address in workers
    ]
    if parallel == PIPELINE:
        sizes = ("--pipeline-parallel-size", str(nodes), "--tensor-parallel-size", str(gpus_per_node))
    else:
        sizes = ("--tensor-parallel-size", str(nodes * gpus_per_node))
    serve = (
        "vllm",
        "serve",
        target,
        "--host",
        head_address,
        "--port",
        str(port),
        "--served-model-name",
        served_name,
        *sizes,
        "--distributed-executor-backend",
        "ray",
        *args,
    )
    steps.append(Step(head, serve))
    return steps
