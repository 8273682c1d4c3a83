"""`GET /v1/models`: the catalog's models in OpenAI's list shape, with what llmgw adds to each entry."""

from __future__ import annotations

from .prospects import Prospect


def entries(models, may_use, waking: dict[str, Prospect]) -> list[dict]:
    """An entry per model and per alias the key may use; `waking` holds the prospects of those not ready.

    OpenAI's fields come first and keep their meaning, so the official clients read the
    list as ever; `llmgw.state` is "ready", "can wake" (a request waits for a replica) or
    "cannot" (a request is refused at once), with the reason for the last two.
    """
    out = []
    for route in models:
        if not may_use(route.name):
            continue
        prospect = waking.get(route.name)
        state = {"state": prospect.state, "reason": prospect.reason + "."} if prospect else {"state": "ready"}
        common = {
            "object": "model",
            "created": route.created,
            "owned_by": "llmgw",
            "ready": bool(route.upstreams),
            "llmgw": state,
        }
        out.append(
            {
                "id": route.name,
                **common,
                "aliases": list(route.aliases),
                "context_length": route.context_length,
                "max_output": route.max_output or None,
                "kind": route.kind,
            }
        )
        out.extend({"id": alias, **common, "alias_of": route.name} for alias in route.aliases)
    return out
