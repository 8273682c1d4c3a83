"""bench/scale.py's control worker: a real one (Celery, prefork), sent a fleet's cycle through Redis, its CPU timed.

A cycle is a heartbeat from every node and the replica reports of a quarter of them, as
each agent sends them (`send_cycle`); the worker's processes' CPU (psutil, from /proc) is
read before and after it has taken the whole cycle (`wait_for_cycle`).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

HEARTBEAT_EVERY_S = 15
# An agent reports each replica on every change and again every 60 s (agent/supervisor.py REREPORT_S),
# so a 15 s cycle of a steady fleet holds a heartbeat from every node and a quarter of the reports.
REPORT_EVERY_S = 60
REPORTS_SPREAD = REPORT_EVERY_S // HEARTBEAT_EVERY_S  # a node in this many reports in a given cycle


def signed(i: int, name: str, kind: str, body: dict) -> dict:
    """A message of node `name` (token-i) as its agent signs it."""
    from contracts import signing

    return signing.sign_message(signing.token_hash(f"token-{i}"), kind, name, body)


def start_control_worker(var: Path, tree: Path) -> tuple[subprocess.Popen, object]:
    """The control worker of `tree` (Celery, prefork, concurrency 2, INFO), as `manage.py up` starts it; up and consuming."""
    argv = [sys.executable, "-m", "celery", "-A", "llmgw_site", "worker", "-Q", "control", "-n", "bench@%h"]
    if profile := os.environ.get("BENCH_WORKER_PROFILE"):  # a file for cProfile's figures (use --pool solo)
        argv[1:1] = ["-m", "cProfile", "-o", profile]
    argv += ["--concurrency", "2", "--loglevel", "INFO", "--without-gossip", "--without-mingle"]
    argv += os.environ.get("BENCH_WORKER_ARGS", "").split()  # later options win: to see what costs what
    log_path = var / "worker.log"
    log = open(log_path, "wb")
    worker = subprocess.Popen(argv, cwd=tree, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while b"[queues]" not in log_path.read_bytes():  # the banner, at any log level
        if time.monotonic() > deadline or worker.poll() is not None:
            os.killpg(worker.pid, 15)
            raise SystemExit(f"the control worker did not start:\n{log_path.read_text()[-2000:]}")
        time.sleep(0.2)
    time.sleep(5)  # the pool's processes up, the consumer connected
    return worker, log


def process_tree_cpu(pid: int) -> float:
    """CPU seconds of a process and all its children."""
    import psutil

    parent = psutil.Process(pid)
    total = 0.0
    for p in [parent, *parent.children(recursive=True)]:
        t = p.cpu_times()
        total += t.user + t.system
    return total


def send_cycle(broker, label: str, posted: bool, case: str, rng, nodes, replicas, endpoints, facts) -> None:
    """A heartbeat from every node and the replica reports of a quarter of them, as `label`'s agents send them."""
    from celery import current_app

    from contracts import tasks

    for i, node in enumerate(nodes):
        beat = facts[node.pk]
        if case == "disk free moves":
            beat = dict(beat, disk_free_bytes=beat["disk_free_bytes"] - rng.randrange(1 << 20))
        reports = [
            [f"token-{i}", replica_id, "ready", endpoints[replica_id], ""]
            for replica_id in (replicas[node.pk] if i % REPORTS_SPREAD == 0 else ())
        ]
        if posted:
            # As the agent sends them now: a heartbeat and a repeated report are posted, signed.
            value = json.dumps(signed(i, node.name, tasks.HEARTBEAT, beat))
            tasks.post_heartbeat(broker, current_app.send_task, node.name, value)
            for report in reports:
                body = dict(zip(("replica", "state", "endpoint", "reason"), report[1:], strict=True))
                value = json.dumps(signed(i, node.name, tasks.REPLICA_REPORT, body))
                tasks.post_report(broker, current_app.send_task, node.name, report[1], value)
            continue
        if label == "new":
            # As messages of their own (BENCH_WORKER_MESSAGES), in the signed form.
            beat_args = [signed(i, node.name, tasks.HEARTBEAT, beat)]
            fields = ("replica", "state", "endpoint", "reason")
            reports = [
                [signed(i, node.name, tasks.REPLICA_REPORT, dict(zip(fields, r[1:], strict=True)))] for r in reports
            ]
        else:
            beat_args = [f"token-{i}", beat]  # the old code's agents: the token first
        current_app.send_task(tasks.HEARTBEAT, args=beat_args, queue=tasks.CONTROL_QUEUE)
        for report in reports:
            current_app.send_task(tasks.REPLICA_REPORT, args=report, queue=tasks.CONTROL_QUEUE)


def wait_for_cycle(broker, nodes, started) -> None:
    """Until the control worker has taken the whole cycle: its queue empty, every node's heartbeat saved."""
    from contracts import keys, tasks
    from fleet.models import Node

    deadline = time.monotonic() + 300
    while (
        broker.llen(tasks.CONTROL_QUEUE)
        or any(broker.exists(keys.heartbeat_key(n.name), keys.reports_key(n.name)) for n in nodes)
        or Node.objects.filter(last_heartbeat__lt=started).exists()
    ):
        if time.monotonic() > deadline:
            raise SystemExit("the control worker did not take the cycle within 5 minutes")
        time.sleep(0.5)
    time.sleep(2)  # the last reports, after the last heartbeat


def run_worker_cycles(
    var: Path, label: str, tree: Path, nodes, replicas, endpoints, facts, rounds: int, posted: bool
) -> None:
    from celery import current_app
    from django.utils import timezone

    rng = random.Random(17)
    worker, log = start_control_worker(var, tree)
    try:
        with current_app.connection_for_read() as connection:
            broker = connection.default_channel.client
            for case in ("facts the same", "disk free moves"):
                used = []
                for _ in range(rounds):
                    started = timezone.now()
                    before = process_tree_cpu(worker.pid)
                    send_cycle(broker, label, posted, case, rng, nodes, replicas, endpoints, facts)
                    wait_for_cycle(broker, nodes, started)
                    used.append(process_tree_cpu(worker.pid) - before)
                cycle = statistics.median(used)
                print(
                    f"  control worker {label:<14} {case:<16} {cycle * 1000:8.0f} ms CPU a {HEARTBEAT_EVERY_S} s "
                    f"cycle: {cycle / HEARTBEAT_EVERY_S * 100:5.1f}% of a core  (median of {rounds}; "
                    f"{', '.join(f'{u:.1f}' for u in used)} s)",
                    flush=True,
                )
    finally:
        os.killpg(worker.pid, 15)
        worker.wait(timeout=30)
        log.close()
