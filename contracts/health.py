"""`/healthz` on every process: what it checked, as JSON; 503 with a sentence when something it needs is away.

One shape for the admin server, the gateway, the byte listener and a node's agent,
so a load balancer, systemd or an operator's curl reads them alike. A check is a
function that returns a short detail (or nothing) and raises when what it checks is
away; `needed=False` marks one the process works without for a while (the gateway
serves its last table while PostgreSQL is away), reported but not failing the whole.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from .version import VERSION


@dataclass(frozen=True)
class Check:
    name: str  # "database", "redis", "table"...
    run: Callable[[], str | None]
    needed: bool = True
    # What the process cannot do without it, for the sentence: "cannot answer requests".
    without: str = "cannot work"


def one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text[:300]


def verdict(process: str, checks: list[Check]) -> tuple[int, bytes]:
    """Run each check; 200 when every needed one passed, else 503 with a sentence naming what is away."""
    found, away = {}, []
    for check in checks:
        try:
            detail = check.run()
        except Exception as error:  # a check's whole point is to say what went wrong, not to raise it
            found[check.name] = {"ok": False, "needed": check.needed, "error": one_line(error)}
            if check.needed:
                away.append(f"its {check.name} is away ({one_line(error)}), so it {check.without}")
            continue
        found[check.name] = {"ok": True, "needed": check.needed, **({"detail": detail} if detail else {})}
    body = {"process": process, "version": VERSION, "status": "away" if away else "ok", "checks": found}
    if away:
        body["message"] = f"The {process} is not healthy: " + "; ".join(away) + "."
    return (503 if away else 200), json.dumps(body).encode() + b"\n"
