"""Each llama-server's own count of its load, read every few seconds and posted for the control plane.

From `/metrics`: requests deferred (waiting for a slot) and the tokens of the answers
finished so far; with what the running slots have decoded, their difference between two
reads is the tokens per second. From `/slots`: how many
slots there are, how many are decoding, and the tokens each holds in the KV cache, over
the pool they share. Both need the replica's secret (llama-server answers only /health
without it). Posted as one signed field per replica (contracts/engine_stats.py).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import requests
from prometheus_client.parser import text_string_to_metric_families

from contracts import credentials
from contracts import engine_stats as contract
from contracts.engine_stats import EngineStats

from . import engine_state, progress

log = logging.getLogger("agent.supervisor")

TIMEOUT_S = 2.0


def _samples(text: str) -> dict[str, float]:
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[sample.name] = sample.value
    return found


def read(port: int, secret: str, host: str = "127.0.0.1", session=requests) -> tuple[EngineStats, float] | None:
    """(the stats but tokens per second, the tokens generated so far), or None when the engine does not say."""
    headers = credentials.bearer(secret)
    base = f"http://{host}:{port}"
    try:
        metrics = session.get(f"{base}/metrics", headers=headers, timeout=TIMEOUT_S)
        slots = session.get(f"{base}/slots", headers=headers, timeout=TIMEOUT_S)
    except requests.RequestException:
        return None
    if metrics.status_code != 200 or slots.status_code != 200:
        return None
    try:
        samples = _samples(metrics.text)
        listed = slots.json()
    except ValueError:
        return None
    if not isinstance(listed, list):
        return None
    pool = sum(int(slot.get("n_ctx") or 0) for slot in listed)
    # What each slot keeps in the cache for its prompt reuse: its last prompt and what was
    # generated after it, which llama-server counts as the slot's prompt tokens.
    held = sum(int(slot.get("n_prompt_tokens") or 0) for slot in listed)
    stats = EngineStats(
        slots=len(listed),
        slots_busy=sum(1 for slot in listed if slot.get("is_processing")),
        requests_deferred=int(samples.get("llamacpp:requests_deferred", 0)),
        kv_cache_used=round(min(1.0, held / pool), 4) if pool else 0.0,
        tokens_per_second=0.0,
        at=time.time(),
    )
    # llama-server adds an answer's tokens to its counter when the answer ends: with what the
    # running slots have decoded so far, the count moves while long answers run too.
    running = sum(
        int(t.get("n_decoded") or 0)
        for slot in listed
        if slot.get("is_processing")
        for t in slot.get("next_token") or ()
    )
    return stats, float(samples.get("llamacpp:tokens_predicted_total", 0.0)) + running


class StatsReader:
    """Reads every ready llama.cpp replica of this node and posts what it says; a thread in the supervisor."""

    def __init__(
        self, cache: Path, node: str, key: str, host: str = "127.0.0.1", interval: float = contract.INTERVAL_S
    ):
        self.cache, self.node, self.key, self.host, self.interval = Path(cache), node, key, host, interval
        self.session = requests.Session()
        # replica -> (tokens generated so far, when): the last read, for the rate.
        self.last: dict[int, tuple[float, float]] = {}

    def once(self) -> dict[int, EngineStats]:
        try:
            entries = list(engine_state.read_state(self.cache)["replicas"].values())
        except OSError:
            return {}
        found: dict[int, EngineStats] = {}
        for entry in entries:
            if entry.get("engine") != "llamacpp" or not entry.get("ready") or not entry.get("port"):
                continue
            replica_id = int(entry["replica"])
            secret = credentials.replica_secret(self.key, replica_id, entry.get("nonce", ""))
            read_now = read(entry["port"], secret, self.host, self.session)
            if read_now is None:
                continue
            stats, predicted = read_now
            before = self.last.get(replica_id)
            if before and stats["at"] > before[1] and predicted >= before[0]:
                stats["tokens_per_second"] = round((predicted - before[0]) / (stats["at"] - before[1]), 2)
            self.last[replica_id] = (predicted, stats["at"])
            found[replica_id] = stats
        for gone in set(self.last) - set(found):
            self.last.pop(gone, None)
        return found

    def post(self, found: dict[int, EngineStats]) -> None:
        if not found or not self.key:
            return
        client = progress.redis_client()
        pipe = client.pipeline(transaction=False)
        for replica_id, stats in found.items():
            pipe.hset(
                contract.stats_key(self.node), str(replica_id), contract.encode(self.node, self.key, replica_id, stats)
            )
        pipe.execute()

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.post(self.once())
            except Exception:
                # Redis away for a moment, an engine between states: the next read makes it good.
                log.warning("the engines' load could not be read or posted", exc_info=True)
            stop.wait(self.interval)
