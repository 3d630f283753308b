"""The plan solver of :func:`dtensor.auto_shard`: the k best assignments of a cost table.

This module owns :class:`Problem` (a pairwise cost table: one choice per variable, a cost
and a memory per choice and per pair of choices, a memory budget) and :func:`solve`, which
returns its ``k`` cheapest assignments that fit the budget, in order. Two backends give the
same answers:

- ``"milp"``: an integer linear program solved by :func:`scipy.optimize.milp` (binary
  ``x[v, c]``, one choice per variable; each pair term a continuous ``y`` in [0, 1] tied by
  ``y <= x[a]``, ``y <= x[b]``, ``y >= x[a] + x[b] - 1``, so ``y = x[a] x[b]`` at every
  integer point); the next best assignment is found after a cut that excludes the ones
  already found;
- ``"bnb"``: depth-first branch and bound in pure Python, with a lower bound per open
  variable (its cheapest choice given the assigned ones, plus every negative pair term it
  could still take).

``"auto"`` takes ``"milp"`` when scipy is importable, else ``"bnb"``. Pure: no data, no
communication.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from placements.errors import ArgumentError

__all__ = ["Problem", "Solution", "has_milp", "solve"]

Pair = tuple[int, int, int, int]  # (variable a, choice of a, variable b, choice of b), a < b


@dataclass(frozen=True)
class Problem:
    """A pairwise cost table.

    Attributes
    ----------
    cost : sequence of sequence of float
        ``cost[v][c]``: the cost of choice ``c`` of variable ``v``.
    pair_cost : mapping of (a, ca, b, cb) to float
        Extra cost when variable ``a`` takes ``ca`` and ``b`` takes ``cb`` (``a < b``).
    memory : sequence of sequence of float, optional
        ``memory[v][c]``, like ``cost``; zeros when left out.
    pair_memory : mapping, optional
        Like ``pair_cost``, for the memory.
    budget : float or None
        The largest total memory (``base_memory`` included) an assignment may have.
    base_memory : float
        Memory that every assignment has.
    """

    cost: Sequence[Sequence[float]]
    pair_cost: Mapping[Pair, float] = field(default_factory=dict)
    memory: Sequence[Sequence[float]] | None = None
    pair_memory: Mapping[Pair, float] = field(default_factory=dict)
    budget: float | None = None
    base_memory: float = 0.0

    def __post_init__(self) -> None:
        sizes = [len(c) for c in self.cost]
        if any(n == 0 for n in sizes):
            raise ArgumentError(f"auto_shard solver: a variable without choices ({sizes})")
        if self.memory is not None and [len(m) for m in self.memory] != sizes:
            raise ArgumentError("auto_shard solver: memory and cost tables differ in shape")
        for a, ca, b, cb in itertools.chain(self.pair_cost, self.pair_memory):
            if not (0 <= a < b < len(sizes) and 0 <= ca < sizes[a] and 0 <= cb < sizes[b]):
                raise ArgumentError(
                    f"auto_shard solver: pair term {(a, ca, b, cb)} outside the table {sizes}"
                )

    def mem(self, v: int, c: int) -> float:
        return 0.0 if self.memory is None else float(self.memory[v][c])

    def evaluate(self, choice: Sequence[int]) -> tuple[float, float]:
        """``(cost, memory)`` of a full assignment (memory with ``base_memory``)."""
        cost = sum(float(self.cost[v][c]) for v, c in enumerate(choice))
        mem = self.base_memory + sum(self.mem(v, c) for v, c in enumerate(choice))
        for (a, ca, b, cb), value in self.pair_cost.items():
            if choice[a] == ca and choice[b] == cb:
                cost += value
        for (a, ca, b, cb), value in self.pair_memory.items():
            if choice[a] == ca and choice[b] == cb:
                mem += value
        return cost, mem

    def fits(self, memory: float) -> bool:
        return self.budget is None or memory <= self.budget * (1 + 1e-9) + 1e-9


@dataclass(frozen=True, order=True)
class Solution:
    """One assignment: its cost, its memory and the choice per variable."""

    cost: float
    memory: float
    choice: tuple[int, ...]


def has_milp() -> bool:
    """Whether scipy's ``milp`` is importable. **Local**."""
    try:
        from scipy.optimize import milp  # noqa: F401  # lazy: scipy is optional
    except ImportError:
        return False
    return True


def solve(problem: Problem, k: int = 1, backend: str = "auto") -> list[Solution]:
    """The ``k`` cheapest assignments of ``problem`` within its budget, cheapest first.
    **Local**.

    Parameters
    ----------
    problem : Problem
    k : int
        How many assignments at most (fewer when fewer fit).
    backend : {"auto", "milp", "bnb"}

    Returns
    -------
    list of Solution
        Empty when no assignment fits the budget.
    """
    if backend == "auto":
        backend = "milp" if has_milp() else "bnb"
    if backend == "milp":
        return _solve_milp(problem, k)
    if backend == "bnb":
        return _solve_bnb(problem, k)
    raise ArgumentError(f"auto_shard solver: unknown backend {backend!r}; use auto, milp or bnb")


# -- ILP (scipy) ----------------------------------------------------------------------------------
def _solve_milp(problem: Problem, k: int) -> list[Solution]:
    from scipy.optimize import Bounds, LinearConstraint, milp  # lazy: scipy is optional

    index = {}
    for v, choices in enumerate(problem.cost):
        for c in range(len(choices)):
            index[v, c] = len(index)
    pairs = sorted(set(problem.pair_cost) | set(problem.pair_memory))
    n_x, n = len(index), len(index) + len(pairs)
    objective = np.zeros(n)
    memory = np.zeros(n)
    for (v, c), i in index.items():
        objective[i] = problem.cost[v][c]
        memory[i] = problem.mem(v, c)
    rows, lo, hi = [], [], []

    def row(entries: dict[int, float], low: float, high: float) -> None:
        r = np.zeros(n)
        for i, value in entries.items():
            r[i] = value
        rows.append(r)
        lo.append(low)
        hi.append(high)

    for v, choices in enumerate(problem.cost):
        row({index[v, c]: 1.0 for c in range(len(choices))}, 1.0, 1.0)
    for j, (a, ca, b, cb) in enumerate(pairs):
        y, xa, xb = n_x + j, index[a, ca], index[b, cb]
        objective[y] = problem.pair_cost.get((a, ca, b, cb), 0.0)
        memory[y] = problem.pair_memory.get((a, ca, b, cb), 0.0)
        row({y: 1.0, xa: -1.0}, -np.inf, 0.0)
        row({y: 1.0, xb: -1.0}, -np.inf, 0.0)
        row({y: 1.0, xa: -1.0, xb: -1.0}, -1.0, np.inf)
    if problem.budget is not None:
        row(dict(enumerate(memory)), -np.inf, problem.budget - problem.base_memory + 1e-9)
    integrality = np.concatenate([np.ones(n_x), np.zeros(len(pairs))])
    found: list[Solution] = []
    for _ in range(k):
        result = milp(
            objective,
            constraints=LinearConstraint(np.array(rows), lo, hi),
            integrality=integrality,
            bounds=Bounds(0, 1),
        )
        if result.x is None:
            break
        choice = tuple(
            max(range(len(ch)), key=lambda c, v=v: result.x[index[v, c]])
            for v, ch in enumerate(problem.cost)
        )
        cost, mem = problem.evaluate(choice)
        if not problem.fits(mem):
            break
        found.append(Solution(cost, mem, choice))
        # exclude this assignment: at most (variables - 1) of its choices together
        row({index[v, c]: 1.0 for v, c in enumerate(choice)}, -np.inf, len(choice) - 1)
    return found


# -- branch and bound (pure Python) ---------------------------------------------------------------
def _solve_bnb(problem: Problem, k: int) -> list[Solution]:
    nv = len(problem.cost)
    pc: dict[tuple[int, int], dict[tuple[int, int], float]] = {}
    pm: dict[tuple[int, int], dict[tuple[int, int], float]] = {}
    for table, terms in ((pc, problem.pair_cost), (pm, problem.pair_memory)):
        for (a, ca, b, cb), value in terms.items():
            table.setdefault((b, cb), {})[a, ca] = value  # looked up when b is assigned
            table.setdefault((a, ca), {})  # (a < b: a is assigned first)

    def later_min(table: dict, v: int, c: int) -> float:
        """The most negative total that pair terms of (v, c) with later variables can add."""
        total = 0.0
        for (b, cb), terms in table.items():
            if b > v:
                for (a, ca), value in terms.items():
                    if (a, ca) == (v, c) and value < 0:
                        total += value
        return total

    neg_cost = [[later_min(pc, v, c) for c in range(len(ch))] for v, ch in enumerate(problem.cost)]
    neg_mem = [[later_min(pm, v, c) for c in range(len(ch))] for v, ch in enumerate(problem.cost)]
    best: list[tuple[float, float, tuple[int, ...]]] = []  # a max-heap of (-cost, ...)

    def gain(table: dict, choice: list[int], v: int, c: int) -> float:
        terms = table.get((v, c))
        if not terms:
            return 0.0
        return sum(value for (a, ca), value in terms.items() if choice[a] == ca)

    def bound(choice: list[int], v0: int) -> tuple[float, float]:
        """Lower bounds of the cost and memory that variables v0.. can still add."""
        cost = mem = 0.0
        for v in range(v0, nv):
            cost += min(
                problem.cost[v][c] + gain(pc, choice, v, c) + neg_cost[v][c]
                for c in range(len(problem.cost[v]))
            )
            mem += min(
                problem.mem(v, c) + gain(pm, choice, v, c) + neg_mem[v][c]
                for c in range(len(problem.cost[v]))
            )
        return cost, mem

    def visit(choice: list[int], v: int, cost: float, mem: float) -> None:
        if v == nv:
            if problem.fits(mem):
                entry = (-cost, -mem, tuple(choice))
                if len(best) < k:
                    heapq.heappush(best, entry)
                elif entry > best[0]:
                    heapq.heapreplace(best, entry)
            return
        order = sorted(
            range(len(problem.cost[v])),
            key=lambda c: problem.cost[v][c] + gain(pc, choice, v, c),
        )
        for c in order:
            choice[v] = c
            step_cost = problem.cost[v][c] + gain(pc, choice, v, c)
            step_mem = problem.mem(v, c) + gain(pm, choice, v, c)
            low_cost, low_mem = bound(choice, v + 1)
            if len(best) == k and cost + step_cost + low_cost >= -best[0][0] - 1e-12:
                continue
            if not problem.fits(mem + step_mem + low_mem):
                continue
            visit(choice, v + 1, cost + step_cost, mem + step_mem)
        choice[v] = -1

    visit([-1] * nv, 0, 0.0, problem.base_memory)
    found = sorted(best, key=lambda e: (-e[0], e[2]))
    return [Solution(*problem.evaluate(choice), choice) for _, _, choice in found]
