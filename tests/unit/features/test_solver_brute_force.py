"""The auto-shard plan solver (:func:`dtensor.autoshard.solve`, both backends) against brute
force on hundreds of random small tables.

The tables have negative pair terms, in cost and in memory (two choices that share a buffer
need less than the sum of their parts), and budgets from generous to tight: at the smallest
memory any assignment has (exactly one, or a few, assignments fit), at low quantiles, and
below every assignment (none fits). The brute force evaluates every assignment at once on a
numpy grid (the table's terms added along its axes), independently of
:meth:`Problem.evaluate` and of both backends.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from dtensor.autoshard import Problem, solve

pytestmark = pytest.mark.mode_independent  # a pure table solver, not dispatch

TRIALS = {"bnb": 400, "milp": 50}


def _grid(sizes, unary, pairs):
    """The sum of the unary terms and the pair terms over every assignment, as an array with
    one axis per variable."""
    out = np.zeros(sizes)
    for v, values in enumerate(unary):
        shape = [1] * len(sizes)
        shape[v] = sizes[v]
        out += np.asarray(values, float).reshape(shape)
    for (a, ca, b, cb), value in pairs.items():
        key = [slice(None)] * len(sizes)
        key[a], key[b] = ca, cb
        out[tuple(key)] += value
    return out


def brute_force(sizes, cost, pair_cost, memory, pair_memory, budget, base, k):
    """The k cheapest costs of the assignments within the budget, and every assignment's
    (cost, memory) by its choice."""
    costs = _grid(sizes, cost, pair_cost)
    mems = _grid(sizes, memory, pair_memory) + base
    fits = np.ones(sizes, bool) if budget is None else mems <= budget * (1 + 1e-9) + 1e-9
    return np.sort(costs[fits])[:k], costs, mems


def random_table(rng, tight):
    nv = int(rng.integers(1, 7))
    sizes = [int(rng.integers(1, 5)) for _ in range(nv)]
    while np.prod(sizes) > 600:
        sizes[int(np.argmax(sizes))] -= 1
    cost = [rng.normal(0, 1, n).round(3) for n in sizes]
    memory = [rng.uniform(0, 10, n).round(3) for n in sizes]
    pair_cost, pair_memory = {}, {}
    for a, b in itertools.combinations(range(nv), 2):
        for ca, cb in itertools.product(range(sizes[a]), range(sizes[b])):
            if rng.random() < 0.35:
                pair_cost[a, ca, b, cb] = float(rng.normal(0, 1.5))
            if rng.random() < 0.35:  # mostly negative: shared buffers
                pair_memory[a, ca, b, cb] = float(rng.uniform(-8, 2))
    base = float(rng.uniform(0, 5))
    mems = np.sort(_grid(sizes, memory, pair_memory).ravel()) + base
    kind = tight % 5
    if kind == 0:
        budget = None
    elif kind == 1:
        budget = float(mems[0])  # only the leanest fit(s)
    elif kind == 2:
        budget = float(mems[len(mems) // 10])
    elif kind == 3:
        budget = float(mems[len(mems) // 2])
    else:
        budget = float(mems[0]) - 0.5  # nothing fits
    return sizes, cost, pair_cost, memory, pair_memory, budget, base


@pytest.mark.parametrize("backend", sorted(TRIALS))
def test_solver_matches_brute_force_on_hundreds_of_tables(backend):
    rng = np.random.default_rng(2026)
    kinds = {"none fit": 0, "some fit": 0}
    for trial in range(TRIALS[backend]):
        sizes, cost, pc, memory, pm, budget, base = random_table(rng, trial)
        problem = Problem([list(c) for c in cost], pc, [list(m) for m in memory], pm, budget,
                          base)
        k = 1 + trial % 4
        want, costs, mems = brute_force(sizes, cost, pc, memory, pm, budget, base, k)
        got = solve(problem, k, backend)
        kinds["none fit" if want.size == 0 else "some fit"] += 1
        where = f"trial {trial}: sizes {sizes}, budget {budget}, k {k}"
        assert len(got) == len(want), f"{where}: {len(got)} plans, brute force {len(want)}"
        np.testing.assert_allclose([s.cost for s in got], want, rtol=0, atol=1e-9,
                                   err_msg=where)
        for s in got:  # each plan is what its choice gives, within the budget
            assert s.cost == pytest.approx(costs[s.choice], abs=1e-9), where
            assert s.memory == pytest.approx(mems[s.choice], abs=1e-9), where
            assert budget is None or s.memory <= budget * (1 + 1e-9) + 1e-9, where
        assert len({s.choice for s in got}) == len(got), where
    assert min(kinds.values()) > TRIALS[backend] // 10, kinds  # both outcomes drawn often
