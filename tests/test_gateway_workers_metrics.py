"""`manage.py gateway --workers 2`: whichever process takes a scrape, /metrics shows the whole gateway's counts
(issue 41 item 7: "two gateway workers each count alone").

A real gateway of two uvicorn processes on one port. Requests without a key (each answered 401 and counted)
go over fresh connections, so the kernel hands them to both processes; the processes' snapshot files say how
many each answered, which is what a scrape showed before: that process's alone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import psutil
import pytest
import requests
from django.conf import settings
from prometheus_client.parser import text_string_to_metric_families

from gateway.keys import create_key
from gateway.prometheus import shared_dir

from .services import free_port
from .support.factories import add_model, add_replica
from .support.gateway import client, held_stream, until_routed
from .support.gateway_process import start_gateway
from .support.processes import BASE_DIR, process_env
from .support.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

TOKEN = "a-scrapers-token-of-some-length"


class TwoWorkers:
    def __init__(self, process, url: str) -> None:
        self.process, self.url = process, url
        port = int(url.rsplit(":", 1)[1])
        self.counts_dir = shared_dir(settings.VAR_DIR, "127.0.0.1", port)

    def workers(self) -> list[int] | None:
        """The uvicorn worker processes running under the supervisor (not one killed and not yet reaped)."""
        found = []
        for child in psutil.Process(self.process.popen.pid).children(recursive=True):
            try:
                if child.status() != psutil.STATUS_ZOMBIE and "multiprocessing.resource" not in " ".join(
                    child.cmdline()
                ):
                    found.append(child.pid)
            except psutil.Error:
                continue  # gone between the listing and the look
        return found if len(found) >= 2 else None

    def send(self, path: str, n: int) -> None:
        for _ in range(n):
            # A new connection each: the kernel picks a process for each.
            answer = requests.post(self.url + path, json={}, headers={"Connection": "close"}, timeout=30)
            assert answer.status_code == 401, answer.text

    def scraped(self, kind: str, family: str = "llmgw_gateway_requests_total") -> float:
        """The scraped count of requests to `kind` answered 401, from whichever process took the scrape; or, with
        another family, its sample whose model is `kind`."""
        answer = requests.get(
            self.url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}", "Connection": "close"}, timeout=30
        )
        assert answer.status_code == 200, answer.text
        for metric in text_string_to_metric_families(answer.text):
            for sample in metric.samples:
                if sample.name != family:
                    continue
                if family == "llmgw_gateway_requests_total":
                    if sample.labels["kind"] == kind and sample.labels["status"] == "401":
                        return sample.value
                elif sample.labels["model"] == kind:
                    return sample.value
        return 0

    def by_process(self, kind: str, tally: str = "requests") -> dict[int, float]:
        """What each process's own snapshot counts: what a scrape of that process alone showed before."""
        counted = {}
        for path in self.counts_dir.glob("*.json"):
            try:
                written = json.loads(path.read_text())
            except ValueError:
                continue  # not possible when written whole and renamed, but said clearly if it happens
            where = 1 if tally == "requests" else 0  # requests: (model, kind, ...); the rest: (model, ...)
            counted[int(path.stem)] = sum(n for labels, n in written[tally] if labels[where] == kind)
        return counted

    def every_scrape_shows(self, kind: str, total: int, scrapes: int = 12) -> list[float]:
        seen = [self.scraped(kind) for _ in range(scrapes)]
        return seen if all(n == total for n in seen) else None


@pytest.fixture(scope="module")
def two_workers(django_db_setup, tmp_path_factory):
    process, url = start_gateway(tmp_path_factory.mktemp("workers"), workers=2, LLMGW_METRICS_TOKEN=TOKEN)
    gateway = TwoWorkers(process, url)
    try:
        wait_until(gateway.workers, timeout=30, what="two worker processes")
        yield gateway
    finally:
        process.stop()


def until_both_answered(gateway: TwoWorkers, path: str, kind: str) -> int:
    """Requests to `path`, ten at a time, until both processes have answered some; how many were sent."""
    for sent in range(10, 210, 10):
        gateway.send(path, 10)
        counted = wait_until(
            lambda sent=sent: (c := gateway.by_process(kind)) and sum(c.values()) == sent and c,
            timeout=30,
            what=lambda sent=sent: f"the processes' snapshots to count {sent} requests: {gateway.by_process(kind)}",
        )
        if len([n for n in counted.values() if n]) >= 2:
            return sent
    raise AssertionError(f"after {sent} requests on fresh connections one process answered them all")


def test_every_scrape_of_a_two_process_gateway_shows_the_requests_both_answered(two_workers):
    sent = until_both_answered(two_workers, "/v1/embeddings", "embedding")
    # Each process alone counted fewer than were sent: what a scrape showed when each counted alone.
    alone = two_workers.by_process("embedding")
    assert all(n < sent for n in alone.values()) and sum(alone.values()) == sent, alone

    wait_until(
        lambda: two_workers.every_scrape_shows("embedding", sent),
        timeout=30,
        what=lambda: f"every scrape to show {sent} requests; they show {[two_workers.scraped('embedding') for _ in range(6)]}",
    )


def test_a_worker_killed_with_sigkill_takes_nothing_from_the_gateways_count(two_workers):
    sent = until_both_answered(two_workers, "/v1/rerank", "rerank")
    wait_until(lambda: two_workers.every_scrape_shows("rerank", sent), timeout=30, what=f"every scrape to show {sent}")
    before = two_workers.workers()
    victim = max(before, key=lambda pid: two_workers.by_process("rerank").get(pid, 0))

    os.kill(victim, signal.SIGKILL)

    # uvicorn starts another in its place; until then and after, no scrape shows fewer.
    def replaced() -> bool:
        assert two_workers.scraped("rerank") == sent
        workers = two_workers.workers()
        return bool(workers) and victim not in workers and len(workers) >= 2

    wait_until(replaced, timeout=60, what=f"uvicorn to start a process in place of {victim}")
    for _ in range(12):
        assert two_workers.scraped("rerank") == sent

    two_workers.send("/v1/rerank", 10)
    wait_until(
        lambda: two_workers.every_scrape_shows("rerank", sent + 10),
        timeout=30,
        what=f"every scrape to show {sent + 10}, the killed process's requests with the rest",
    )


def test_the_requests_in_flight_of_a_killed_worker_are_no_longer_counted(two_workers, replicas):
    add_model()
    replica = replicas()
    add_replica("chat", replica.base)
    _, secret = create_key("held")
    until_routed(client(secret), two_workers.url)
    held = []
    try:
        # Held streams, each on a new connection, until both processes hold some.
        for _ in range(40):
            held.append(held_stream(two_workers.url, secret))
            assert held[-1].status_code == 200, held[-1].text
            in_flight = wait_until(
                lambda: (c := two_workers.by_process("chat", "in_flight")) and sum(c.values()) == len(held) and c,
                timeout=30,
                what=lambda: f"the snapshots to count {len(held)} in flight: {two_workers.by_process('chat', 'in_flight')}",
            )
            if len([n for n in in_flight.values() if n]) >= 2:
                break
        else:
            raise AssertionError(f"after {len(held)} streams one process holds them all")
        wait_until(
            lambda: all(two_workers.scraped("chat", "llmgw_gateway_in_flight") == len(held) for _ in range(12)),
            timeout=30,
            what=f"every scrape to show {len(held)} in flight",
        )
        victim = next(pid for pid, n in in_flight.items() if n)

        os.kill(victim, signal.SIGKILL)
        # Its streams went with it; the others' are still held, and counted whichever process is scraped.
        left = len(held) - in_flight[victim]
        wait_until(
            lambda: all(two_workers.scraped("chat", "llmgw_gateway_in_flight") == left for _ in range(12)),
            timeout=30,
            what=lambda: f"every scrape to show {left} in flight once {victim} is gone; they show "
            f"{[two_workers.scraped('chat', 'llmgw_gateway_in_flight') for _ in range(6)]}",
        )
    finally:
        replica.release.set()
        for stream in held:
            stream.close()


def test_a_counts_directory_that_cannot_be_made_stops_the_gateway_with_a_sentence(tmp_path):
    (tmp_path / "gateway-counts").write_text("a file where the directory goes")
    env = process_env(LLMGW_VAR=tmp_path, LLMGW_GATEWAY_ADDR=f"127.0.0.1:{free_port()}")
    done = subprocess.run(
        [sys.executable, "manage.py", "gateway", "--workers", "2"],
        env=env,
        cwd=BASE_DIR,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "The workers share their counts in" in done.stderr and "could not be made" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
