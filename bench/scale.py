#!/usr/bin/env python
"""The control plane's periodic jobs at fleet size: CPU per pass, old code beside new, in one run.

    .venv/bin/python bench/scale.py [--jobs mirror,gateway,heartbeats] [--sizes 1x,10x,100x] [--runs 3]
    .venv/bin/python bench/scale.py --jobs gateway-load [--load-keys 100,100000] [-- --quick]

Builds the sizes of issue 17 in a temporary directory (files empty, rows in bulk)
and runs each periodic job with nothing changing and with 1% changing between
passes, timing the process's CPU (SQLite runs in the process, so its work is
counted too):

  mirror scan    every 20 s   1x: 1,000 versions / 3,000 files; 10x: 10,000 / 30,000; all hashed
  gateway table  every 1 s    1x: 1,000 keys / 100 models; 10x: 10,000 / 1,000; 100x: 100,000 / 1,000;
                              one ready replica a model
  heartbeats     every 15 s   1,000 nodes, each a heartbeat, and 3 replica reports every 60 s (the
                              tasks' bodies, in this process)
  worker         every 15 s   the same through Redis to a real control worker: its CPU, Celery's included

"old" is the algorithm as it was before issue 17, kept below in this file
(old_scan_mirror, old_load_table, old_heartbeat, old_replica_report), run
against the same database and files in the same run. Old passes at the largest
mirror size take about half a minute each, so they run once there.

--jobs gateway-load runs bench/gateway.py (llmgw alone, no LiteLLM) once with each
number of API keys in the database, to show a request costs the same with 100,000.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import ROOT, Servers, django_setup, timed  # noqa: E402
from scale_gateway_load import bench_gateway_load, gateway_load_child  # noqa: E402
from scale_old import old_heartbeat, old_load_table, old_replica_report, old_scan_mirror, old_tree  # noqa: E402
from scale_worker import HEARTBEAT_EVERY_S, REPORTS_SPREAD, run_worker_cycles, signed  # noqa: E402

MIRROR_SIZES = {"1x": (1_000, 3), "10x": (10_000, 3)}  # versions, files each
GATEWAY_SIZES = {"1x": (1_000, 100), "10x": (10_000, 1_000), "100x": (100_000, 1_000)}  # keys, models
SCAN_EVERY_S, REFRESH_EVERY_S = 20, 1


def cpu(fn) -> float:
    return timed(fn, 1, time.process_time)[0]


def median_cpu(fn, runs: int, before=None) -> float:
    return timed(fn, runs, time.process_time, before)[0]


def line(job: str, size: str, case: str, old: float, new: float, every_s: float) -> None:
    print(
        f"  {job:<14} {size:<5} {case:<16} old {old * 1000:10.1f} ms  new {new * 1000:8.2f} ms   "
        f"per second of schedule: old {old / every_s * 1000:8.2f} ms  new {new / every_s * 1000:7.3f} ms   "
        f"({old / new if new else float('inf'):,.0f}x)",
        flush=True,
    )


# --- the mirror scan --------------------------------------------------------------------------


def bench_mirror(sizes: list[str], runs: int, mirror_root: Path) -> None:
    for size in sizes:
        if size in MIRROR_SIZES:
            bench_mirror_size(size, runs, mirror_root)


def bench_mirror_size(size: str, runs: int, mirror_root: Path) -> None:
    from mirror import scan
    from mirror.models import MirrorFile, MirrorVersion

    rng = random.Random(17)
    versions, per_version = MIRROR_SIZES[size]
    MirrorVersion.objects.all().delete()
    for child in mirror_root.iterdir():
        for version in child.iterdir():
            for f in version.iterdir():
                f.unlink()
            version.rmdir()
        child.rmdir()
    files = []
    for v in range(versions):
        directory = mirror_root / f"model-{v // 10:04}" / f"v{v % 10}"
        directory.mkdir(parents=True)
        for n in range(per_version):
            path = directory / f"part-{n}-of-{per_version}.gguf"
            with open(path, "wb") as fh:
                fh.truncate(rng.randrange(1, 1 << 30))  # sparse: a size, no blocks
            files.append(path)
    scan.scan_mirror()

    def all_hashed():
        MirrorFile.objects.update(sha256="0" * 64)

    def change_one_percent():
        all_hashed()
        for path in rng.sample(files, len(files) // 100):
            st = path.stat()
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))

    print(f"mirror: {versions:,} versions, {len(files):,} files", flush=True)
    old_runs = 1 if versions >= 10_000 else runs
    old = median_cpu(old_scan_mirror, old_runs, all_hashed)
    new = median_cpu(scan.scan_mirror, runs, all_hashed)
    line("mirror scan", size, "nothing changed", old, new, SCAN_EVERY_S)
    old = median_cpu(old_scan_mirror, old_runs, change_one_percent)
    new = median_cpu(scan.scan_mirror, runs, change_one_percent)
    line("mirror scan", size, "1% changed", old, new, SCAN_EVERY_S)


# --- the gateway's table ------------------------------------------------------------------------


def bench_gateway(sizes: list[str], runs: int) -> None:
    for size in sizes:
        if size in GATEWAY_SIZES:
            bench_gateway_size(size, runs)


def build_gateway_table(n_keys: int, n_models: int) -> tuple[list[int], list[int]]:
    """`n_keys` keys and `n_models` models with a ready replica each, written in bulk; their ids."""
    from django.utils import timezone

    from catalog.models import Model, Profile
    from fleet.models import Node, Replica
    from gateway.keys import hash_key
    from gateway.models import ApiKey, TableChange

    ApiKey.objects.all().delete()
    Replica.objects.all().delete()
    Model.objects.all().delete()
    ApiKey.objects.bulk_create(
        (
            ApiKey(name=f"key-{i:06}", prefix="llmgw-bench", key_hash=hash_key(f"bench-{i}"), model_names=[])
            for i in range(n_keys)
        ),
        batch_size=2000,
    )
    models = Model.objects.bulk_create(
        Model(name=f"model-{i:04}", source=f"http://mirror:8001/model-{i:04}/v1/", context_length=4096)
        for i in range(n_models)
    )
    Profile.objects.bulk_create(Profile(model=m, name="cpu", engine="llamacpp") for m in models)
    node, _ = Node.objects.get_or_create(name="bench-node")
    Replica.objects.bulk_create(
        Replica(
            model_name=m.name,
            profile_name="cpu",
            node=node,
            state="ready",
            endpoint=f"http://10.0.{i // 250}.{i % 250}:8080/v1",
            since=timezone.now(),
        )
        for i, m in enumerate(models)
    )
    TableChange.objects.all().delete()  # the building's marks, long past
    return list(ApiKey.objects.values_list("pk", flat=True)), list(Replica.objects.values_list("pk", flat=True))


def bench_gateway_size(size: str, runs: int) -> None:
    from fleet.models import Replica
    from gateway import routes
    from gateway.models import ApiKey

    rng = random.Random(17)
    n_keys, n_models = GATEWAY_SIZES[size]
    key_ids, replica_ids = build_gateway_table(n_keys, n_models)
    print(f"gateway: {n_keys:,} keys, {n_models:,} models, {len(replica_ids):,} ready replicas", flush=True)

    reader = routes.TableReader()
    reader.read()
    old = median_cpu(old_load_table, runs)
    # Nothing changed: many refreshes, since one takes well under a millisecond.
    refreshes = 200

    def refresh_many():
        for _ in range(refreshes):
            reader.read()

    new = cpu(refresh_many) / refreshes
    assert reader.full_reads == 1
    line("gateway table", size, "nothing changed", old, new, REFRESH_EVERY_S)

    changes = iter(range(1, 1_000_000))

    def change_one_percent():
        # 1% of the keys get new model lists, 1% of the replicas a new endpoint.
        n = next(changes)
        ApiKey.objects.filter(pk__in=rng.sample(key_ids, max(1, len(key_ids) // 100))).update(
            model_names=[f"model-{n}"]
        )
        Replica.objects.filter(pk__in=rng.sample(replica_ids, max(1, len(replica_ids) // 100))).update(
            endpoint=f"http://10.1.0.{n % 250}:8080/v1"
        )

    old = median_cpu(old_load_table, runs, change_one_percent)
    # On the gateway's schedule, a second apart: each look reaches back OVERLAP, so the
    # marks of the last few seconds are fetched again (and skipped) on every refresh.
    times = []
    for _ in range(max(runs, 3) + 5):
        change_one_percent()
        time.sleep(REFRESH_EVERY_S)
        times.append(cpu(reader.read))
    new = statistics.median(times[5:])
    line("gateway table", size, "1% changed", old, new, REFRESH_EVERY_S)
    whole = routes.load()
    assert reader.table.keys == whole.keys and reader.table.routes == whole.routes, "the reader fell behind"


# --- heartbeats and reports ---------------------------------------------------------------------


def build_fleet(n_nodes: int = 1000, per_node: int = 3):
    """n_nodes enrolled nodes (token-i), each running per_node ready replicas; what each one's agent reports."""
    from django.utils import timezone

    from fleet.enrolment import hash_token
    from fleet.models import Node, Replica

    Replica.objects.all().delete()
    Node.objects.all().delete()
    now = timezone.now()
    nodes = Node.objects.bulk_create(
        Node(
            name=f"node-{i:04}",
            token_hash=hash_token(f"token-{i}"),
            # Where its replicas' endpoints are (below): the only host the control plane routes to for it.
            address=f"node-{i:04}",
            engines=["llamacpp"],
            memory_gb=64,
            labels={"zone": "eu" if i % 2 else "us"},
            last_heartbeat=now,
        )
        for i in range(n_nodes)
    )
    Replica.objects.bulk_create(
        Replica(
            model_name=f"model-{(i * per_node + r) % 1000:04}",
            profile_name="cpu",
            node=node,
            state="ready",
            endpoint=f"http://{node.name}:{8080 + r}/v1",
            source="http://mirror:8001/m/v1/",
            engine="llamacpp",
            since=now,
        )
        for i, node in enumerate(nodes)
        for r in range(per_node)
    )
    replicas = {}
    for pk, node_id in Replica.objects.values_list("pk", "node_id"):
        replicas.setdefault(node_id, []).append(pk)
    endpoints = dict(Replica.objects.values_list("pk", "endpoint"))
    facts = {
        node.pk: {
            "node": node.name,
            "engines": ["llamacpp"],
            "gpus": [],
            "memory_gb": 64,
            "disk_free_bytes": 500 << 30,
            "labels": node.labels,
            "agent_version": "0.1.0",
        }
        for node in nodes
    }
    return nodes, replicas, endpoints, facts


def bench_heartbeats(runs: int, n_nodes: int = 1000, per_node: int = 3) -> None:
    from contracts import tasks as contract
    from fleet import tasks

    nodes, replicas, endpoints, facts = build_fleet(n_nodes, per_node)
    print(f"heartbeats: {n_nodes:,} nodes, {per_node} replicas each, every {HEARTBEAT_EVERY_S} s", flush=True)
    rng = random.Random(17)

    def cycle(heartbeat, report, changing: bool):
        def run():
            for i, node in enumerate(nodes):
                beat = facts[node.pk]
                if changing:
                    # Free disk moves with every download and log line: it differs on most beats.
                    beat = dict(beat, disk_free_bytes=beat["disk_free_bytes"] - rng.randrange(1 << 20))
                    if i % 100 == 0:
                        beat["labels"] = dict(beat["labels"], rack=str(rng.randrange(10)))
                heartbeat(i, node.name, beat)
                if i % REPORTS_SPREAD == 0:
                    for replica_id in replicas[node.pk]:
                        report(i, node.name, replica_id, "ready", endpoints[replica_id], "")

        return run

    def old_beat(i, name, facts):
        old_heartbeat(f"token-{i}", facts)

    def old_report(i, name, *report):
        old_replica_report(f"token-{i}", *report)

    # The new ones are signed here, as the node signs them: the node's HMAC is counted with the control
    # plane's check of it (about as dear), so the figure is an upper bound.
    def new_beat(i, name, facts):
        tasks.heartbeat.run(signed(i, name, contract.HEARTBEAT, facts))

    def new_report(i, name, replica_id, state, endpoint, reason):
        body = {"replica": replica_id, "state": state, "endpoint": endpoint, "reason": reason}
        tasks.replica_report.run(signed(i, name, contract.REPLICA_REPORT, body))

    for case, changing in (("facts the same", False), ("disk free moves", True)):
        old = median_cpu(cycle(old_beat, old_report, changing), runs)
        new = median_cpu(cycle(new_beat, new_report, changing), runs)
        line("heartbeats", "1000", case, old, new, HEARTBEAT_EVERY_S)
    print(
        f"  (a {HEARTBEAT_EVERY_S} s cycle is {n_nodes:,} heartbeats and {n_nodes * per_node // REPORTS_SPREAD:,} "
        f"reports; 10% of a core is {HEARTBEAT_EVERY_S * 100:.0f} ms of CPU a cycle)"
    )


def bench_worker(var: Path, old_ref: str | None, rounds: int, n_nodes: int = 1000, per_node: int = 3) -> None:
    """A real control worker (Celery, prefork, 2 processes, INFO logs, as `manage.py up` runs it) taking
    15 s cycles of heartbeats and reports from the broker: its CPU, Celery's own work included."""
    nodes, replicas, endpoints, facts = build_fleet(n_nodes, per_node)
    reports = n_nodes * per_node // REPORTS_SPREAD
    print(f"control worker: {n_nodes:,} heartbeats and {reports:,} reports a cycle, through Redis", flush=True)
    # BENCH_WORKER_TREE: run "new" from another copy of the code, e.g. with a setting changed, to see what it does.
    trees = [("new", Path(os.environ.get("BENCH_WORKER_TREE", ROOT)))] + (
        [(f"old ({old_ref})", old_tree(old_ref, var))] if old_ref else []
    )
    for label, tree in trees:
        # The old code's agents sent a Celery message for each heartbeat and report.
        posted = label == "new" and os.environ.get("BENCH_WORKER_MESSAGES") is None
        run_worker_cycles(var, label, tree, nodes, replicas, endpoints, facts, rounds, posted)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument(
        "--jobs", default="mirror,gateway,heartbeats,worker", help="also: gateway-load (bench/gateway.py), alone"
    )
    parser.add_argument("--sizes", default="1x,10x,100x")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--worker-old-ref", help="also run the control worker from this commit (git archive)")
    parser.add_argument("--database-url", help="an empty database to use instead of SQLite in the work directory")
    parser.add_argument("--load-keys", default="100,100000", help="API keys for each gateway-load run")
    parser.add_argument("--gateway-load-child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("gateway_args", nargs="*", help="after --: passed to bench/gateway.py")
    options = parser.parse_args()
    jobs, sizes = options.jobs.split(","), options.sizes.split(",")
    if options.gateway_load_child is not None:
        gateway_load_child(options.gateway_load_child, options.gateway_args)
        return 0
    if jobs == ["gateway-load"]:
        bench_gateway_load([int(n) for n in options.load_keys.split(",")], options.gateway_args)
        return 0

    # The work directory is kept: its database is what the figures were measured on.
    with Servers("llmgw-bench-scale-", keep=True) as servers:
        if "worker" in jobs:
            os.environ["REDIS_URL"] = f"redis://127.0.0.1:{servers.redis()[1]}/0"
        run_jobs(jobs, sizes, options, servers.work)
    return 0


def run_jobs(jobs: list[str], sizes: list[str], options, var: Path) -> None:
    mirror_root = var / "mirror"
    mirror_root.mkdir()
    os.environ.update(
        LLMGW_VAR=str(var),
        LLMGW_MIRROR_ROOT=str(mirror_root),
        DATABASE_URL=options.database_url or f"sqlite:///{var / 'bench.sqlite3'}",
    )
    os.environ.pop("DJANGO_DEBUG", None)
    import logging

    django_setup()
    logging.disable(logging.WARNING)  # a refused report or skipped name is not what is measured
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    print(f"CPU per pass (median of {options.runs}), process time: Python and SQLite together; in {var}")
    if "mirror" in jobs:
        bench_mirror(sizes, options.runs, mirror_root)
    if "gateway" in jobs:
        bench_gateway(sizes, options.runs)
    if "heartbeats" in jobs:
        bench_heartbeats(options.runs)
    if "worker" in jobs:
        bench_worker(var, options.worker_old_ref, options.runs)


if __name__ == "__main__":
    sys.exit(main())
