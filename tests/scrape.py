"""Reading /metrics back in tests: Prometheus's text format into {(sample name, labels): value}."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def value(found: dict, name: str, **labels) -> float:
    """One sample's value; 0 when the series is not there (a counter never incremented)."""
    return found.get((name, frozenset({k: str(v) for k, v in labels.items()}.items())), 0.0)


def total(found: dict, name: str, **labels) -> float:
    """The sum over every series of `name` whose labels include these."""
    want = {k: str(v) for k, v in labels.items()}.items()
    return sum(v for (n, have), v in found.items() if n == name and want <= have)
