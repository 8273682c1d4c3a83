"""The serve page's memory figure: from the weights' header where one was read, else the seed's rule.

The estimate itself is `catalog.memory.estimate` (the replicas page shows it too); this
module decides which figure fills the field and says so (docs/serve.md), and keeps the
field following the context pool as staff type it.
"""

from __future__ import annotations

from collections.abc import Mapping

from catalog.memory import MB, Estimate, checked, estimate

from .planning import WHOLE_NUMBER, ServePlan, memory_for


def _whole(value: str | None) -> int:
    value = (value or "").strip()
    return int(value) if WHOLE_NUMBER.fullmatch(value) else 0


def engine_args(engine: str, ctx_size: str) -> list[str]:
    """The arguments the form's fields would give the engine that the estimate reads."""
    pool = _whole(ctx_size)
    return ["--ctx-size", str(pool)] if engine == "llamacpp" and pool else []


def offer(headers: Mapping | None, engine: str, bytes_total: int, ctx_size: str = "", parallel: str = "") -> dict:
    """What the memory field says and why: {gb, source, estimate (its parts, in MB), reason}.

    `source` is "header" when the weights' header gives an estimate, "size" when the
    seed's rule (size × 1.5 + 2 GB) fills the field instead, with `reason` saying why.
    """
    headers = dict(headers) if isinstance(headers, Mapping) else {}
    found: Estimate | None = None
    if engine:
        found = estimate(headers, engine, engine_args(engine, ctx_size), parallel=_whole(parallel) or 1)
    if found is None:
        # checked's sentence: not read yet, could not be read, or numbers that are not (issue 34).
        problem = checked(headers)
        reason = problem if isinstance(problem, str) else "the weights' header gives nothing to estimate from"
        return {"gb": memory_for(bytes_total), "source": "size", "reason": reason, "estimate": None}
    parts = {
        "weights_mb": round(found.weights / MB),
        "kv_cache_mb": round(found.kv_cache / MB),
        "prompt_cache_mb": round(found.prompt_cache / MB),
        "overhead_mb": round(found.overhead / MB),
        "total_mb": round(found.total / MB),
        "pool": found.pool,
        "missing": found.missing,
    }
    return {"gb": found.total_gb, "source": "header", "reason": "", "estimate": parts}


def plan_with_estimate(make_plan, headers: Mapping | None) -> ServePlan:
    """The plan, its memory field from the header estimate where there is one; the seed's rule stays otherwise.

    `make_plan(estimated_gb)` is plan_serve with everything else bound: called again with
    the header's figure, so that its warning (a node too small) speaks of the figure shown.
    """
    plan = make_plan(0)
    if plan.refusal or not plan.engine:
        return plan
    found = offer(headers, plan.engine, plan.bytes_total)
    if found["source"] == "header":
        plan = make_plan(found["gb"])
    plan.memory = found
    return plan


def wire(form, url: str) -> None:
    """Make the context pool and the engine ask for the estimate again as they are typed (htmx)."""
    ask = {
        "hx-get": url,
        "hx-trigger": "input changed delay:200ms, change",
        "hx-target": "#memory-estimate",
        "hx-swap": "outerHTML",
        "hx-include": "closest form",
    }
    for name in ("ctx_size", "engine", "parallel"):
        if name in form.fields:
            form.fields[name].widget.attrs.update(ask)
    # A number staff type themselves is theirs: the estimate stops filling the field.
    form.fields["min_memory_gb"].widget.attrs["oninput"] = "this.dataset.typed = '1'"


def for_form(headers: Mapping | None, data: Mapping, bytes_total: int) -> dict:
    """The offer for what the form says now: its engine, its context pool, its slots."""
    return offer(
        headers,
        str(data.get("engine") or ""),
        bytes_total,
        str(data.get("ctx_size") or ""),
        str(data.get("parallel") or ""),
    )


def follows(data: Mapping) -> bool:
    """Whether the memory field still holds the figure last estimated (or nothing): staff's own number is kept."""
    typed = str(data.get("min_memory_gb") or "").strip()
    return not typed or typed == str(data.get("memory_estimated_gb") or "").strip()
