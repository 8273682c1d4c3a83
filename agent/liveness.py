"""Whether a ready engine still serves: asked every so often, and given time while it is busy.

A ready engine that stops answering its health check is hung (alive but serving nobody)
and is killed and started again, unless it is busy: llama.cpp answers no check while it
reads a long prompt. The supervisor (agent/supervisor_loop.py) asks; `verdict` decides.
"""

from __future__ import annotations

import logging

import psutil

log = logging.getLogger("agent.supervisor")

# A ready engine is asked whether it still answers this often; after this many
# unanswered checks in a row it is taken for hung (alive but serving nobody), killed
# and started again. Generous, because an engine busy generating answers slowly.
LIVENESS_INTERVAL_S = 10.0
LIVENESS_TIMEOUT_S = 5.0
LIVENESS_FAILURES = 3
# An unanswered check does not count while the engine is busy: using at least this share
# of a core since the last check. llama.cpp answers no check while it reads a long prompt
# (a megabyte took 30-38 s), and killing it then cut every other request; a hung engine
# (deadlocked, stopped) uses none. Busy and silent for this long, it is taken for stuck in
# a loop: the gateway has given up on its requests by then (LLMGW_GATEWAY_UPSTREAM_TIMEOUT_S).
BUSY_CPU_SHARE = 0.05
LIVENESS_BUSY_GRACE_S = 600.0


def verdict(entry: dict, answered: bool, cpu: float | None, now: float, *, failures: int, busy_grace: float) -> str:
    """Why the engine of this state entry is to be killed after its check, or "" to leave it; the entry's
    counts (`checked`, `cpu`, `unanswered`, `busy_since`) are brought up to date."""
    last_cpu, last_checked = entry.get("cpu"), entry.get("checked")
    entry["checked"], entry["cpu"] = now, cpu
    if answered:
        entry.update(unanswered=0, busy_since=None)
        return ""
    busy = None not in (last_cpu, last_checked, cpu) and (
        cpu - last_cpu >= BUSY_CPU_SHARE * max(now - last_checked, 0.001)
    )
    if busy:
        entry["unanswered"] = 0
        entry["busy_since"] = entry.get("busy_since") or now
        if now - entry["busy_since"] < busy_grace:
            log.info("replica %s: the engine is busy and did not answer its check; left to work", entry["replica"])
            return ""
        return f"stopped answering (busy and silent for {now - entry['busy_since']:.0f} s)"
    entry["busy_since"] = None
    entry["unanswered"] = entry.get("unanswered", 0) + 1
    if entry["unanswered"] < failures:
        return ""
    return f"stopped answering ({failures} health checks in a row went unanswered)"


def cpu_seconds(pid: int) -> float | None:
    """CPU time the engine and its children have used so far; None when it cannot be read."""
    try:
        process = psutil.Process(pid)
        members = [process, *process.children(recursive=True)]
    except psutil.Error:
        return None
    used = 0.0
    for member in members:
        try:
            used += sum(member.cpu_times()[:2])  # user and system
        except psutil.Error:
            pass  # a child that ended meanwhile
    return used
