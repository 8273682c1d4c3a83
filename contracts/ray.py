"""vLLM across several nodes (issue 37): a Ray cluster over the group, then `vllm serve` on its head.

vLLM spreads one model over nodes through Ray: the head starts a Ray head, each worker joins it,
and `vllm serve` on the head runs with pipeline parallelism across the nodes (or tensor parallelism
across every GPU of the group). The commands are made here, once, for both sides: the control
plane's account of a group (fleet/ray.py) and the agents that run them (agent/ray_group.py).

A vLLM group travels in the same messages as a llama.cpp one (contracts/groups.py):
- START_RPC_WORKER to each worker, with extra {"engine": "vllm", "head_address": the head's
  enrolled address, "ray_port": the port of the head's Ray}: the worker runs `ray start
  --address=HEAD:PORT --block` and keeps it running; STOP_RPC_WORKER stops it.
- START_REPLICA to the head with extra["group"] a GroupOrder holding "ray_port": the head runs
  `ray start --head --block`, waits until `ray status` counts every node of the group, then
  starts `vllm serve` with the sizes below and RAY_ADDRESS pointing at its Ray.

`--block` keeps each `ray start` in the foreground for as long as Ray runs on that node, so the
agent supervises it like any engine: it exits when Ray's processes die, and stopping its process
group stops them. `ray stop` is never used: it stops every Ray on the host, another group's too.

This cannot run here (no GPU): tests/test_vllm_group.py runs it on real agents against stand-ins.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

# Ray's default port for its head (GCS).
RAY_PORT = 6379
PIPELINE, TENSOR = "pipeline", "tensor"
# Printed by `ray start` once its node is up (a head) or has joined the head (a worker).
STARTED = "Ray runtime started"


@dataclass(frozen=True)
class Step:
    """One command on one node; the next step starts once this one's Ray is up (Ray's) or answers (vLLM's)."""

    node: str
    argv: tuple[str, ...]


def head_argv(address: str, port: int = RAY_PORT, ray: str = "ray") -> tuple[str, ...]:
    """The group's head: a Ray head on its enrolled address, kept in the foreground."""
    return (ray, "start", "--head", f"--port={port}", f"--node-ip-address={address}", "--block")


def worker_argv(head_address: str, address: str, port: int = RAY_PORT, ray: str = "ray") -> tuple[str, ...]:
    """A worker joining the head's Ray from its own enrolled address, kept in the foreground."""
    return (ray, "start", f"--address={head_address}:{port}", f"--node-ip-address={address}", "--block")


def status_argv(head_address: str, port: int = RAY_PORT, ray: str = "ray") -> tuple[str, ...]:
    return (ray, "status", f"--address={head_address}:{port}")


# "Node status" lists each node as " 1 node_<id>" under Healthy: (older Ray), or Active: and Idle:
# (autoscaler v2), before Pending:. Nodes still pending are not in the cluster.
_NODE_LINE = re.compile(r"^\s*(\d+)\s+node_\w+")


def joined_nodes(status: str) -> int:
    """How many nodes `ray status` says are in the cluster (0 when it says nothing readable)."""
    counted, inside = 0, False
    for line in status.splitlines():
        if line.strip() == "Node status":
            inside = True
        elif inside and line.strip().startswith(("Pending:", "Resources", "Recent failures:")):
            break
        elif inside and (match := _NODE_LINE.match(line)):
            counted += int(match.group(1))
    return counted


def given(args: Sequence[str], *flags: str) -> str | None:
    """The value a profile gives one of these flags (`--flag V` or `--flag=V`), or None."""
    for n, arg in enumerate(args):
        name, equals, value = arg.partition("=")
        if name in flags:
            if equals:
                return value
            return args[n + 1] if n + 1 < len(args) else None
    return None


def serve_sizes(nodes: int, gpus_per_node: int = 1, parallel: str = PIPELINE) -> tuple[str, ...]:
    """vLLM's parallel sizes for a group of `nodes`, and Ray as its executor.

    Pipeline: the layers split across the nodes (`--pipeline-parallel-size` the node count), each
    node's GPUs in tensor parallel; the default, since it crosses the network once per token per
    stage rather than once per layer. Tensor: every GPU of the group in one tensor-parallel group.
    """
    if parallel not in (PIPELINE, TENSOR):
        raise ValueError(f"parallel is {parallel!r}, not {PIPELINE} or {TENSOR}")
    if parallel == PIPELINE:
        sizes = ("--pipeline-parallel-size", str(nodes), "--tensor-parallel-size", str(gpus_per_node))
    else:
        sizes = ("--tensor-parallel-size", str(nodes * gpus_per_node))
    return (*sizes, "--distributed-executor-backend", "ray")


def group_serve_args(nodes: int, args: Sequence[str]) -> list[str]:
    """What the head adds to a profile's vLLM arguments: pipeline stages across the group's nodes.

    A profile's own `--tensor-parallel-size` (`-tp`) is each node's GPUs (1 unless given) and stays
    where it is; a profile that sets the pipeline size or the executor itself keeps its own.
    """
    tp = given(args, "--tensor-parallel-size", "-tp")
    sizes = list(serve_sizes(nodes, int(tp) if tp and tp.isdigit() else 1))
    if tp is not None:
        del sizes[2:4]
    if given(args, "--pipeline-parallel-size", "-pp") is not None:
        del sizes[0:2]
    if given(args, "--distributed-executor-backend") is not None:
        del sizes[-2:]
    return sizes


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
    """The head's Ray head, each worker (name, address) joining it, then vllm serve on the head."""
    sizes = serve_sizes(1 + len(workers), gpus_per_node, parallel)
    steps = [Step(head, head_argv(head_address, ray_port))]
    steps += [Step(name, worker_argv(head_address, address, ray_port)) for name, address in workers]
    serve = ("vllm", "serve", target, "--host", head_address, "--port", str(port))
    steps.append(Step(head, (*serve, "--served-model-name", served_name, *sizes, *args)))
    return steps
