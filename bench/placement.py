#!/usr/bin/env python
"""One reconcile pass over 1,000 nodes and 500 models, timed.

    .venv/bin/python bench/placement.py [--nodes 1000] [--models 500] [--runs 5]

Measures, with medians over --runs:

  place, empty fleet   the pure function placing every replica of every model
  place, steady        the same when every replica is already where it belongs
  pass, first          fleet.reconcile's pass on SQLite: read rows, place, write ~1,000 replicas
  pass, steady         the pass that finds nothing to do (what the beat runs every few seconds)

The fleet is mixed: CPU nodes of 16 to 128 GB running llama.cpp, GPU nodes with
1 to 8 GPUs running both engines, two zones as labels. Models ask for 1 to 3
replicas, some on GPUs, some pinned to a zone, a few too big for any node. The
catalog is given as snapshots; messages to agents are counted, not sent (the
broker is not what is measured). Runs in a temporary directory, touching nothing else.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

from harness import Goal, Servers, django_setup, report, table, timed


def fleet_and_catalog(n_nodes: int, n_models: int, seed: int = 7):
    from fleet.placement import ModelView, NodeView, ProfileView

    rng = random.Random(seed)
    nodes = []
    for i in range(n_nodes):
        zone = "eu" if i % 2 else "us"
        if i % 10 < 7:
            nodes.append(
                NodeView(
                    f"cpu-{i:04}",
                    engines=frozenset({"llamacpp"}),
                    memory_gb=rng.choice([16, 32, 64, 128]),
                    labels={"zone": zone},
                )
            )
        else:
            nodes.append(
                NodeView(
                    f"gpu-{i:04}",
                    engines=frozenset({"llamacpp", "vllm"}),
                    memory_gb=256,
                    gpus=rng.choice([1, 2, 4, 8]),
                    labels={"zone": zone},
                )
            )
    models = []
    for i in range(n_models):
        cpu = ProfileView("cpu", "llamacpp", ("--ctx-size", "4096"), min_memory_gb=rng.choice([4, 8, 12, 24]))
        profiles = [cpu]
        if i % 3 == 0:
            profiles.append(ProfileView("gpu", "vllm", priority=200, min_memory_gb=32, gpus=rng.choice([1, 2])))
        if i % 7 == 0:
            profiles = [ProfileView("pinned", "llamacpp", min_memory_gb=8, node_selector={"zone": "eu"})]
        if i % 97 == 0:
            profiles = [ProfileView("huge", "llamacpp", min_memory_gb=1024)]
        models.append(
            ModelView(f"model-{i:03}", f"http://mirror:8001/model-{i:03}/v1/", rng.choice([1, 2, 3]), tuple(profiles))
        )
    return nodes, models


GOAL_S = 1.0  # issue 5
GOALS = [Goal(f"one pass (the first, the heaviest) under {GOAL_S:g} s", lambda f: f["pass, first"] < GOAL_S)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--models", type=int, default=500)
    parser.add_argument("--runs", type=int, default=5)
    options = parser.parse_args()
    with Servers("llmgw-bench-placement-") as servers:
        _, redis_port = servers.redis()  # the gateway's load, for the scaled pass
        os.environ["REDIS_URL"] = f"redis://127.0.0.1:{redis_port}/0"
        django_setup(servers.work / "var")
        return measure(options)


def measure(options) -> int:
    from django.db import transaction
    from django.utils import timezone

    from fleet import reconcile
    from fleet.models import Node, Replica
    from fleet.placement import ReplicaView, place

    nodes, models = fleet_and_catalog(options.nodes, options.models)
    wanted = sum(m.replicas for m in models)
    figures, notes = {}, {}

    figures["place, empty fleet"], plan = timed(lambda: place(nodes, models, []), options.runs)
    notes["place, empty fleet"] = f"{len(plan.assign)} placed, {len(plan.unplaced)} unplaceable"
    placed = [
        ReplicaView(i, a.model, a.profile.name, a.node, "ready", a.profile.min_memory_gb, a.profile.gpus, a.source)
        for i, a in enumerate(plan.assign)
    ]
    figures["place, steady"], steady = timed(lambda: place(nodes, models, placed), options.runs)
    assert not steady.assign and not steady.stop, "a steady fleet should need nothing done"

    now = timezone.now()
    Node.objects.bulk_create(
        Node(
            name=n.name,
            engines=sorted(n.engines),
            memory_gb=n.memory_gb,
            gpus=[{"name": "gpu"}] * n.gpus,
            labels=n.labels,
            last_heartbeat=now,
        )
        for n in nodes
    )
    sent = []
    reconcile.send_start = lambda replica: sent.append(replica.pk)
    reconcile.send_stop = lambda replica_id, node: sent.append(replica_id)

    def first_pass():
        Replica.objects.all().delete()
        with transaction.atomic():
            return reconcile.reconcile_unlocked(timezone.now(), models)

    figures["pass, first"], pass_plan = timed(first_pass, options.runs)
    notes["pass, first"] = f"{len(pass_plan.assign)} replicas written"
    sent.clear()
    figures["pass, steady"], _ = timed(lambda: reconcile.reconcile_unlocked(timezone.now(), models), options.runs)
    figures["pass, steady, scaled"] = scaled_pass(reconcile, models, options.runs, sent)
    notes["pass, steady, scaled"] = f"{len(sent)} messages to agents"

    print(f"{len(nodes)} nodes, {len(models)} models, {wanted} replicas wanted; median of {options.runs} runs")
    table(["what", "median", ""], [(what, f"{s * 1000:.1f} ms", notes.get(what, "")) for what, s in figures.items()])
    report(GOALS, figures)
    return 0


def scaled_pass(reconcile, models, runs: int, sent: list) -> float:
    """The steady pass with every model between fewest and most and the gateway's load in Redis
    (issue 14): one HGETALL, one read of the counts, a decision per model."""
    import dataclasses

    from django.utils import timezone

    from contracts import demand
    from fleet.live import redis_client
    from fleet.placement import Scaling

    scaled = [dataclasses.replace(m, scaling=Scaling(m.replicas, m.replicas + 2)) for m in models]
    load = {m.name: {"in_flight": m.replicas, "waiting": 0, "last_request": time.time()} for m in models}
    redis_client().hset(demand.LOAD_KEY, "bench", demand.encode({"at": time.time(), "models": load, "replicas": {}}))
    reconcile.reconcile_unlocked(timezone.now(), scaled)
    sent.clear()
    seconds, _ = timed(lambda: reconcile.reconcile_unlocked(timezone.now(), scaled), runs)
    redis_client().hdel(demand.LOAD_KEY, "bench")
    return seconds


if __name__ == "__main__":
    sys.exit(main())
