"""The benchmark harness: a script in bench/ says what it compares and its goals; this does the rest.

A script declares its contenders (a name and one measurement each) and its goals (a
sentence and a test of the figures) beside each other, starts the servers it needs in a
`Servers` (stopped and its work directory removed however the run ends), and hands the
contenders to `side_by_side`, which runs them in rotating order, repeated; `medians` and
`best` reduce the samples, `table` prints the one table and `report` the "met / NOT met"
lines. docs/benchmarks.md, "The harness", shows a script written this way.
"""

from .compare import Goal, best, medians, pct, report, rotation, side_by_side, side_by_side_async, table, timed
from .servers import ROOT, Servers, free_port, until, wait_for
from .site import Site, django_setup, stub_site

__all__ = [
    "ROOT",
    "Goal",
    "Servers",
    "Site",
    "best",
    "django_setup",
    "free_port",
    "medians",
    "pct",
    "report",
    "rotation",
    "side_by_side",
    "side_by_side_async",
    "stub_site",
    "table",
    "timed",
    "until",
    "wait_for",
]
