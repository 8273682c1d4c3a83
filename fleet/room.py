"""Making room: which idle replicas of other models to stop so that a model waking fits.

A pure choice over plain values, so placement (`fleet.placement.place`) can ask it
without this module knowing placement's books: the candidates, how many each model
may lose, what each node has free, and a test of whether the waking model fits.

The rules (docs/placement.md#making-room):
- only replicas with no request in flight, of models whose fewest allows one fewer,
  and never of a model of higher priority than the one waking;
- lower priority first, then the model idle longest;
- on the node where the fewest replicas have to go (ties: the node's name);
- when replicas already stopping would free enough, nothing more is stopped.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    replica: int
    model: str
    node: str
    memory_gb: int
    gpus: int
    priority: int
    last_request: float


# (node, free memory GB, free GPUs) -> whether the waking model fits there
Fits = Callable[[str, int, int], bool]


@dataclass(frozen=True)
class Choice:
    node: str
    # What to stop; empty when replicas already stopping there free enough.
    stop: tuple[Candidate, ...]


def choose(
    candidates: Iterable[Candidate],
    spare: dict[str, int],
    free: dict[str, tuple[int, int]],
    stopping: dict[str, tuple[int, int]],
    fits: Fits,
) -> Choice | None:
    """The node to make room on and what to stop there; None when no choice of idle replicas would do.

    `spare` is how many replicas each model may lose (its count above its fewest);
    `free` what each node has left now, `stopping` what replicas already told to stop
    will give back on it.
    """
    for node in sorted(free):
        memory, gpus = free[node]
        back = stopping.get(node, (0, 0))
        if back != (0, 0) and fits(node, memory + back[0], gpus + back[1]):
            return Choice(node, ())
    order = sorted(candidates, key=lambda c: (c.priority, c.last_request, c.replica))
    rank = {c.replica: i for i, c in enumerate(order)}
    by_node: dict[str, list[Candidate]] = defaultdict(list)
    for candidate in order:
        by_node[candidate.node].append(candidate)
    best: Choice | None = None
    best_key: tuple[int, int] | None = None
    for node in sorted(by_node):
        if node not in free:
            continue
        memory, gpus = free[node]
        back = stopping.get(node, (0, 0))
        memory, gpus = memory + back[0], gpus + back[1]
        left = dict(spare)
        chosen: list[Candidate] = []
        for candidate in by_node[node]:
            if left.get(candidate.model, 0) <= 0:
                continue
            left[candidate.model] -= 1
            chosen.append(candidate)
            memory, gpus = memory + candidate.memory_gb, gpus + candidate.gpus
            if fits(node, memory, gpus):
                # Fewest stopped; among equals, the set whose last victim comes earliest in the order.
                key = (len(chosen), rank[chosen[-1].replica])
                if best_key is None or key < best_key:
                    best, best_key = Choice(node, tuple(chosen)), key
                break
    return best
