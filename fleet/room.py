"""Making room: which idle replicas of other models to stop so that a model waking fits.

A pure choice over plain values, so placement (`fleet.placement.place`) can ask it
without this module knowing placement's books: the candidates, how many each model
may lose, what each node has free, and a test of whether the waking model fits.

The rules (docs/placement.md#making-room):
- only replicas with no request in flight, of models whose fewest allows one fewer,
  and never of a model of higher priority than the one waking;
- by the memory each really frees (the larger of what it was booked at and what its
  node measured), the fewest replicas that make room: one large idle replica rather
  than three small ones;
- among as few, lower priority first, then the model idle longest;
- on the node where the fewest replicas have to go (ties: the earliest victims, then the node's name);
- when replicas already stopping would free enough, nothing more is stopped.

A replica across nodes (issue 37) is one replica here too: stopping it frees its head's memory
and each worker's share, on their nodes, so it counts on every node it holds memory on, and is
stopped whole. A waking model that needs a group (`choose_group`) has room made on the nodes
together: the replicas that free the most memory on usable nodes first, until a group fits,
then every one whose stop turns out not to be needed is kept.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Candidate:
    replica: int
    model: str
    node: str
    memory_gb: int
    gpus: int
    priority: int
    last_request: float
    # Whether memory_gb is what its node measured (more than it was booked at), not its booking.
    measured: bool = False
    # A group's workers (issue 37): (node, GB its share holds there). Stopping the group frees them all.
    shares: tuple[tuple[str, int], ...] = ()

    def frees(self) -> dict[str, tuple[int, int]]:
        """What stopping it gives back, per node: (memory GB, GPUs)."""
        freed = {self.node: (self.memory_gb, self.gpus)}
        for node, memory_gb in self.shares:
            memory, gpus = freed.get(node, (0, 0))
            freed[node] = (memory + memory_gb, gpus)
        return freed


# (node, free memory GB, free GPUs) -> whether the waking model fits there
Fits = Callable[[str, int, int], bool]
# {node: (free memory GB, free GPUs)} -> whether a group of the waking model fits across them
FitsGroup = Callable[[dict[str, tuple[int, int]]], bool]


@dataclass(frozen=True)
class Choice:
    node: str
    # What to stop; empty when replicas already stopping there free enough.
    stop: tuple[Candidate, ...]
    # For a group: every node room is made on (`node` is the first).
    nodes: tuple[str, ...] = ()


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
        # A group counts on each node it holds memory on, by what it frees there.
        for node, (memory, gpus) in candidate.frees().items():
            by_node[node].append(replace(candidate, node=node, memory_gb=memory, gpus=gpus))
    whole = {c.replica: c for c in order}
    best: Choice | None = None
    best_key: tuple[int, int, str] | None = None
    for node in sorted(by_node):
        if node not in free:
            continue
        memory, gpus = free[node]
        back = stopping.get(node, (0, 0))
        chosen = _fewest(by_node[node], spare, memory + back[0], gpus + back[1], lambda m, g, n=node: fits(n, m, g))
        if chosen:
            # Fewest stopped; among equals, the set whose last victim comes earliest in the order.
            key = (len(chosen), max(rank[c.replica] for c in chosen), node)
            if best_key is None or key < best_key:
                best, best_key = Choice(node, tuple(whole[c.replica] for c in chosen)), key
    return best


def choose_group(
    candidates: Iterable[Candidate],
    spare: dict[str, int],
    free: dict[str, tuple[int, int]],
    stopping: dict[str, tuple[int, int]],
    fits: FitsGroup,
) -> Choice | None:
    """What to stop so that a group of the waking model fits across nodes; None when nothing would do.

    The nodes are considered together: `fits` is asked of every usable node's room at once.
    Replicas are taken by the memory they free on usable nodes, most first (then lower
    priority, then idle longest), until a group fits; then each taken, the last in that
    order first, is left running when the group fits without its stop.
    """
    now = _given_back(free, stopping)
    if stopping and fits(now):
        nodes = tuple(sorted(n for n in stopping if n in free))
        return Choice(nodes[0], (), nodes) if nodes else None

    def freed_here(c: Candidate) -> int:
        return sum(memory for node, (memory, _) in c.frees().items() if node in free)

    order = sorted(candidates, key=lambda c: (-freed_here(c), c.priority, c.last_request, c.replica))
    left, taken = dict(spare), []
    for candidate in order:
        if freed_here(candidate) <= 0 or left.get(candidate.model, 0) <= 0:
            continue
        left[candidate.model] -= 1
        taken.append(candidate)
        if fits(_given_back(now, *(c.frees() for c in taken))):
            break
    else:
        return None
    for candidate in reversed(taken[:-1]):
        rest = [c for c in taken if c is not candidate]
        if fits(_given_back(now, *(c.frees() for c in rest))):
            taken = rest
    nodes = tuple(sorted({n for c in taken for n in c.frees() if n in free}))
    return Choice(nodes[0], tuple(taken), nodes)


def _given_back(free: dict[str, tuple[int, int]], *freed: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """`free` with what each of `freed` gives back added, on the nodes `free` has (usable ones)."""
    now = dict(free)
    for back in freed:
        for node, (memory, gpus) in back.items():
            if node in now:
                now[node] = (now[node][0] + memory, now[node][1] + gpus)
    return now


def _fewest(
    order: list[Candidate], spare: dict[str, int], memory: int, gpus: int, fits: Callable[[int, int], bool]
) -> list[Candidate]:
    """The fewest of these candidates (in order: lower priority, then idle longest) whose memory makes room; [] when none do.

    By what each really frees: three small replicas idle longer than one large one are
    not stopped when the large one alone is enough. Among sets of that size, each victim
    is the earliest in the order that still leaves a set of that size able to make room.
    """

    def completes(chosen: list[Candidate], rest: list[Candidate], size: int) -> bool:
        # Whether `chosen` plus the largest of `rest` (within each model's spare) reach `size` and fit.
        left = dict(spare)
        for c in chosen:
            left[c.model] = left.get(c.model, 0) - 1
        if any(v < 0 for v in left.values()):
            return False
        m, g = memory + sum(c.memory_gb for c in chosen), gpus + sum(c.gpus for c in chosen)
        count = len(chosen)
        for c in sorted(rest, key=lambda c: (-c.memory_gb, -c.gpus)):
            if count >= size:
                break
            if left.get(c.model, 0) <= 0:
                continue
            left[c.model] -= 1
            m, g, count = m + c.memory_gb, g + c.gpus, count + 1
        return count == size and fits(m, g)

    for size in range(1, len(order) + 1):
        if not completes([], order, size):
            continue
        chosen: list[Candidate] = []
        for i, candidate in enumerate(order):
            if len(chosen) == size:
                break
            trial = [*chosen, candidate]
            if completes(trial, order[i + 1 :], size):
                chosen = trial
        return chosen
    return []
