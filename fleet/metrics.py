"""The fleet's metrics: read from the rows and Redis at scrape time, and the reconcile pass's own time.

Nodes, replicas, memory as placed and fetches are what the database and the
progress keys say at the moment of the scrape, the same numbers the admin shows;
keeping them in memory as well would be a second record that can disagree. A
scrape costs a handful of grouped queries, whatever the size of the fleet.
"""

from __future__ import annotations

import time
from collections import Counter as Tally
from collections import defaultdict

from django.db.models import Count, Q, Sum
from prometheus_client import Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from common import metrics
from contracts import progress

from . import engine_stats
from .live import redis_client
from .models import Fetch, Node, Replica, heartbeat_deadline
from .placement import PENDING

RECONCILE = Histogram(
    "llmgw_reconcile_duration_seconds",
    "One reconcile pass: read the rows, place, write the plan.",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
# A fetch under way whose progress has not moved for this long is counted as stalled.
STALLED_AFTER_S = 60

# Why a replica could not be placed, as a few bounded words: the reason itself is a
# sentence naming nodes and numbers, which would make a label without end.
REASON_WORDS = (
    ("no node has enrolled", "no_nodes"),
    ("has no profile", "no_profile"),
    ("GB free, needs", "memory"),
    ("GPU", "gpus"),
    ("no label", "labels"),
    (" is ", "labels"),
    ("not ready", "nodes_not_ready"),
    ("draining", "draining"),
    ("no ", "engine"),
)


def reason_kind(reason: str) -> str:
    for words, kind in REASON_WORDS:
        if words in reason:
            return kind
    return "other"


class FleetCollector(Collector):
    def collect(self):
        yield from self.nodes()
        yield from self.replicas()
        yield from self.engines()
        yield from self.fetches()

    def engines(self):
        """What each replica's engine says of its load (fleet.engine_stats), for the replicas whose engine said."""
        stats = engine_stats.read()
        names = dict(Replica.objects.filter(pk__in=stats).values_list("pk", "model_name")) if stats else {}
        labels = ["model", "replica"]
        slots = GaugeMetricFamily(
            "llmgw_engine_slots", "An engine's parallel slots: all, and busy.", labels=[*labels, "kind"]
        )
        deferred = GaugeMetricFamily(
            "llmgw_engine_requests_deferred", "Requests waiting in an engine for a slot.", labels=labels
        )
        kv = GaugeMetricFamily(
            "llmgw_engine_kv_cache_used_ratio", "The share of an engine's context pool in use.", labels=labels
        )
        rate = GaugeMetricFamily(
            "llmgw_engine_tokens_per_second", "Tokens an engine generated per second, lately.", labels=labels
        )
        for pk, found in sorted(stats.items()):
            if pk not in names:
                continue
            key = [names[pk], str(pk)]
            slots.add_metric([*key, "total"], found["slots"])
            slots.add_metric([*key, "busy"], found["slots_busy"])
            deferred.add_metric(key, found["requests_deferred"])
            kv.add_metric(key, found["kv_cache_used"])
            rate.add_metric(key, found["tokens_per_second"])
        yield from (slots, deferred, kv, rate)

    def nodes(self):
        deadline = heartbeat_deadline()
        counts = Node.objects.aggregate(
            n_draining=Count("pk", filter=Q(draining=True)),
            n_ready=Count("pk", filter=Q(draining=False, last_heartbeat__gte=deadline)),
            n_all=Count("pk"),
        )
        by_state = GaugeMetricFamily("llmgw_nodes", "Nodes by state.", labels=["state"])
        by_state.add_metric(["ready"], counts["n_ready"])
        by_state.add_metric(["draining"], counts["n_draining"])
        by_state.add_metric(["not_ready"], counts["n_all"] - counts["n_ready"] - counts["n_draining"])
        yield by_state

        booked = {
            row["node_id"]: row
            # Placement books every replica on its node, whatever its state (fleet.placement.books.book_held).
            for row in Replica.objects.filter(node__isnull=False)
            .values("node_id")
            .annotate(memory=Sum("memory_gb"), gpus=Sum("gpus"))
        }
        memory = GaugeMetricFamily(
            "llmgw_node_memory_gb", "Memory per node: total, and used and free as placed.", labels=["node", "kind"]
        )
        gpus = GaugeMetricFamily(
            "llmgw_node_gpus", "GPUs per node: total, and used and free as placed.", labels=["node", "kind"]
        )
        for node_id, name, memory_gb, node_gpus in Node.objects.values_list("pk", "name", "memory_gb", "gpus"):
            used = booked.get(node_id, {})
            used_memory, used_gpus, total_gpus = used.get("memory") or 0, used.get("gpus") or 0, len(node_gpus or ())
            memory.add_metric([name, "total"], memory_gb)
            memory.add_metric([name, "used"], used_memory)
            memory.add_metric([name, "free"], max(memory_gb - used_memory, 0))
            gpus.add_metric([name, "total"], total_gpus)
            gpus.add_metric([name, "used"], used_gpus)
            gpus.add_metric([name, "free"], max(total_gpus - used_gpus, 0))
        yield memory
        yield gpus

    def replicas(self):
        by_state = GaugeMetricFamily("llmgw_replicas", "Replicas by model and state.", labels=["model", "state"])
        for row in Replica.objects.values("model_name", "state").annotate(n=Count("pk")).order_by():
            by_state.add_metric([row["model_name"], row["state"]], row["n"])
        yield by_state
        unplaced = GaugeMetricFamily(
            "llmgw_replicas_unplaced",
            "Replicas placement could not put on any node, by the kind of reason.",
            labels=["reason"],
        )
        kinds = Tally(
            reason_kind(reason)
            for reason in Replica.objects.filter(state=PENDING, node__isnull=True)
            .exclude(reason="")
            .values_list("reason", flat=True)
        )
        for kind, n in sorted(kinds.items()):
            unplaced.add_metric([kind], n)
        yield unplaced

    def fetches(self):
        recorded = GaugeMetricFamily(
            "llmgw_fetches", "Fetches as the control plane recorded them, by state.", labels=["state"]
        )
        counts = dict(Fetch.objects.values_list("state").annotate(n=Count("pk")).order_by())
        for state in Fetch.State.values:
            recorded.add_metric([state], counts.get(state, 0))
        yield recorded

        under_way = GaugeMetricFamily("llmgw_fetches_under_way", "Fetches a node is working on now.", labels=["node"])
        rate = GaugeMetricFamily(
            "llmgw_fetch_bytes_per_second", "What the fetches under way transfer, per node.", labels=["node"]
        )
        stalled = GaugeMetricFamily(
            "llmgw_fetches_stalled",
            f"Fetches under way whose progress has not moved for {STALLED_AFTER_S} s, per node.",
            labels=["node"],
        )
        counts, rates, stuck = defaultdict(int), defaultdict(int), defaultdict(int)
        try:
            client = redis_client()
            now = time.time()
            enrolled = Node.objects.values_list("name", flat=True)
            for _source, snapshots in progress.read_recent(client, enrolled):
                for node, snapshot in snapshots.items():
                    if snapshot.get("state") not in ("queued", "fetching", "verifying"):
                        continue
                    counts[node] += 1
                    rates[node] += int(snapshot.get("rate") or 0)
                    if now - float(snapshot.get("updated") or now) > STALLED_AFTER_S:
                        stuck[node] += 1
        except Exception:
            pass  # Redis away: the live numbers are missing, the rest of the scrape is not
        for node in sorted(counts):
            under_way.add_metric([node], counts[node])
            rate.add_metric([node], rates[node])
            stalled.add_metric([node], stuck[node])
        yield under_way
        yield rate
        yield stalled


def install() -> None:
    metrics.register_fleet(FleetCollector())
