"""The whole-model search of :func:`auto_shard`.

This module owns :func:`auto_shard`. The cost of a placement assignment is known only by
tracing a step (activations follow the dispatcher's per-op choices, which depend on every
parameter upstream), so the search works in rounds around a base assignment (first the
given placements):

1. trace the base, and each assignment that moves one tensor (parameter or input) to one
   of its other candidates: the single moves' time and memory deltas;
2. trace pairs of the most improving single moves: their interaction (the joint delta
   minus the two single ones);
3. solve the resulting pairwise cost table (:mod:`dtensor.autoshard._solve`, an ILP or
   branch and bound) for its ``top_k`` best assignments within the memory budget, and
   trace each of them;
4. the best traced assignment that fits the budget becomes the next base; stop when it
   does not change.

With a budget, the rounds also run without it (every trace shared): their tables' memory
is an estimate from single and pairwise moves, so the rounds under the budget may prune
their way off a plan that fits; the answer is the fastest traced assignment that fits,
so a budget met by the plan found without one gives that plan or a faster one.

Every reported prediction is that of a trace, so the chosen plan's predicted time is that
of the ops the dispatcher runs for it, never the cost table's estimate.

Before the rounds, on a real mesh of more than one rank (``fit_step``), the step runs
in up to four layouts that differ in what they cost (the given placements; every searched
input at its last candidate, split along its first dim: data parallel; every parameter
at its first candidate other than the given one, and at its last one: sharded along the
first and the last dims; only those whose predicted peak fits the memory budget), and
the calibration's compute scale and fixed costs per op entry and per collective are
refitted to their measured times (:func:`dtensor.autoshard._calibrate.fit_to_steps`):
what a step of this model pays for its kernels, per op and per collective on this
machine as it runs, which the calibration's single kernels and small step do not show.
The search then prices with the fitted calibration.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from placements.errors import ArgumentError, DTypeError
from placements.layout import max_local_shape
from placements.types import Placement, Replicate, placement_list
from redistribute.cost import default_cost_model

from ..distributed.abstract import AbstractDTensor, AbstractMesh
from ..distributed.dtensor import DTensor
from ._calibrate import Calibration, fit_to_steps, load_calibration
from ._measure import measure_steps
from ._plan import Candidate, ShardingPlan, StepFit
from ._predict import Layout, Prediction, as_array, candidate_placements, predict_step
from ._solve import Problem, has_milp, solve

__all__ = ["auto_shard"]


def _global(v: Any) -> Any:
    """The global array of a parameter or input. **Collective** for a DTensor (Local for a
    metadata-only one: an array of its shape that holds no data)."""
    if isinstance(v, DTensor) and not isinstance(v, AbstractDTensor):
        return v.detach().full_tensor().numpy()
    return as_array(v)


class _Search:
    """The variables (tensors with their candidate layouts) and a cache of traced
    assignments (one trace per distinct assignment)."""

    def __init__(self, step_fn: Callable, params: Mapping[str, Any], inputs: Mapping[str, Any],
                 mesh: Any, calibration: Calibration, optimizer: Callable | None,
                 choices: Mapping[str, Sequence[Layout]], fixed_inputs: Mapping[str, Any],
                 budget: float | None) -> None:
        self.step_fn, self.mesh, self.cal, self.optimizer = step_fn, mesh, calibration, optimizer
        self.params, self.inputs, self.fixed = params, inputs, fixed_inputs
        self.names = list(choices)
        self.choices = [list(choices[n]) for n in self.names]
        self.budget = budget
        self.seen: dict[tuple[int, ...], Prediction] = {}
        self.sources: dict[tuple[int, ...], list[str]] = {}

    def layouts(self, choice: Sequence[int]) -> dict[str, Layout]:
        return {n: self.choices[v][c] for v, (n, c) in enumerate(zip(self.names, choice))}

    def fit(self, start: tuple[int, ...], repeat: int) -> StepFit | None:
        """Measure the step in the fit layouts whose predicted peak fits the budget (see
        the module docstring), refit the calibration's compute scale and fixed costs to
        them and price with it from now on; None when no fit layout fits the budget.
        **Collective**."""
        dp, first, last = list(start), list(start), list(start)
        for v, (name, ch) in enumerate(zip(self.names, self.choices)):
            if name not in self.params:
                dp[v] = len(ch) - 1
            elif len(ch) > 1:
                first[v] = 1 if start[v] == 0 else 0
                last[v] = len(ch) - 1 if start[v] != len(ch) - 1 else len(ch) - 2
        choices = list(dict.fromkeys((start, tuple(dp), tuple(first), tuple(last))))
        inputs = {**self.inputs, **self.fixed}
        layouts, before = [], []
        for c in choices:
            p = predict_step(self.step_fn, self.params, inputs, self.mesh, self.layouts(c),
                             optimizer=self.optimizer, calibration=self.cal)
            if self.fits(p):
                layouts.append(self.layouts(c))
                before.append(p)
        if not layouts:
            return None
        seconds = measure_steps(self.step_fn, self.params, inputs, self.mesh, layouts,
                                self.optimizer, repeat)
        self.cal = fit_to_steps(self.cal, before, seconds)
        return StepFit(layouts, seconds, [p.time_s for p in before],
                       [p.time_with(self.cal) for p in before], self.cal.compute_scale,
                       self.cal.entry_s, self.cal.sync_s)

    def fits(self, p: Prediction) -> bool:
        return self.budget is None or p.peak_bytes <= self.budget

    def evaluate(self, choice: Sequence[int], source: str) -> Prediction:
        """The prediction of one assignment (traced once). **Collective**."""
        key = tuple(choice)
        found = self.seen.get(key)
        if found is None:
            found = self.seen[key] = predict_step(
                self.step_fn, self.params, {**self.inputs, **self.fixed}, self.mesh,
                self.layouts(key), optimizer=self.optimizer, calibration=self.cal)
        tags = self.sources.setdefault(key, [])
        if source not in tags:
            tags.append(source)
        return found

    def best(self) -> tuple[int, ...] | None:
        fitting = [k for k, p in self.seen.items() if self.fits(p)]
        return min(fitting, key=lambda k: (self.seen[k].time_s, k)) if fitting else None

    def rounds(self, base: tuple[int, ...], rounds: int, top_k: int, pairs: int, backend: str,
               budget: float | None) -> Problem:
        """Search rounds from ``base`` (module docstring, steps 1-4) under ``budget`` (None:
        none), which stays this search's budget; returns the last round's cost table.
        **Collective** (it traces)."""
        self.budget = budget
        problem = None
        for _ in range(rounds):
            problem = self.table(base, pairs)
            for s in solve(problem, top_k, backend):
                self.evaluate(s.choice, "solver")
            best = self.best()
            if best is None or best == base:
                break
            base = best
        return problem

    def table(self, base: tuple[int, ...], pairs: int) -> Problem:
        """The pairwise cost table around ``base``. **Collective** (it traces)."""
        b = self.evaluate(base, "base")
        cost = [[0.0] * len(ch) for ch in self.choices]
        memory = [[0.0] * len(ch) for ch in self.choices]
        moves = []
        for v, ch in enumerate(self.choices):
            for c in range(len(ch)):
                if c == base[v]:
                    continue
                choice = list(base)
                choice[v] = c
                p = self.evaluate(choice, "single")
                cost[v][c] = p.time_s - b.time_s
                memory[v][c] = p.peak_bytes - b.peak_bytes
                moves.append((cost[v][c], v, c))
        moves.sort()
        top = [(v, c) for d, v, c in moves if d < 0][:pairs]
        pair_cost, pair_memory = {}, {}
        for i, (v, c) in enumerate(top):
            for w, d in top[i + 1:]:
                if v == w:
                    continue
                (a, ca), (bb, cb) = sorted(((v, c), (w, d)))
                choice = list(base)
                choice[a], choice[bb] = ca, cb
                p = self.evaluate(choice, "pair")
                pair_cost[a, ca, bb, cb] = p.time_s - b.time_s - cost[a][ca] - cost[bb][cb]
                pair_memory[a, ca, bb, cb] = (p.peak_bytes - b.peak_bytes - memory[a][ca]
                                              - memory[bb][cb])
        return Problem(cost, pair_cost, memory, pair_memory, self.budget, b.peak_bytes)


def _layout(value: Any, name: str, mesh: Any) -> Layout:
    pl = tuple(value)
    if len(pl) != mesh.ndim or not all(isinstance(p, Placement) for p in pl):
        raise DTypeError(f"auto_shard: candidates[{name!r}] holds {value!r}, not "
                         f"{mesh.ndim} placements")
    return pl


def _check_budget(memory_budget: object) -> None:
    """Refuse a ``memory_budget`` that is not a finite number of bytes > 0 (None: none)."""
    if memory_budget is None:
        return
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, numbers.Real):
        raise DTypeError(
            f"auto_shard: memory_budget={memory_budget!r} ({type(memory_budget).__name__}) "
            "must be a number of bytes per rank (an int such as 2 * 2**30), or None")
    if not (math.isfinite(memory_budget) and memory_budget > 0):
        raise ArgumentError(
            f"auto_shard: memory_budget={memory_budget!r} must be a finite number of bytes "
            "per rank > 0, or None")


def auto_shard(step_fn: Callable, params: Mapping[str, Any], inputs: Mapping[str, Any],
               mesh: Any, memory_budget: int | None = None, *,
               optimizer: Callable | None = None, calibration: Calibration | None = None,
               candidates: Mapping[str, Sequence[Sequence[Placement]]] | None = None,
               search_inputs: bool = True, top_k: int = 4, pairs: int = 8, rounds: int = 3,
               solver: str = "auto", fit_step: bool = False, fit_repeat: int = 7,
               pipeline: Any = None) -> ShardingPlan:
    """Search the placements of a model's parameters (and inputs) for the fastest
    training step that fits a memory budget. **Collective** over ``mesh`` (it runs traced
    steps; every rank must call it with the same arguments).

    The search traces steps of candidate assignments with :func:`dtensor.debug.explain`,
    prices each trace (compute per op class from the calibration, collectives from the
    dispatcher's cost model; per-rank peak memory) and solves pairwise cost tables for the
    best assignment (see :mod:`dtensor.autoshard`). Activations are placed by the
    dispatcher's own choices.

    Parameters
    ----------
    step_fn : callable
        ``step_fn(params, inputs) -> loss`` (a scalar tensor); the search runs its
        ``backward()`` (and the optimizer step) after it.
    params : dict of str to DTensor or array
        The parameters: DTensors (their placements are the first base) or arrays of the
        global values (the same on every rank; first base: replicated).
    inputs : dict of str to object
        One step's inputs. Arrays (numpy or local tensors) are placed by the search when
        ``search_inputs`` (candidates ``Replicate`` / ``Shard(0)`` per mesh dim, first base
        replicated), else replicated; DTensors and other values are passed as they are.
    mesh : DeviceMesh or AbstractMesh
        On an :class:`~dtensor.AbstractMesh` the search is **Local** and needs no data:
        every step it traces runs on metadata-only DTensors (parameters and inputs may be
        :func:`~dtensor.abstract_like` / :func:`~dtensor.abstract_tensor` tensors or
        arrays), so a layout for a mesh far larger than this machine can be planned in one
        process.
    memory_budget : int, optional
        Per-rank peak bytes the plan's predicted step may use (a finite number > 0). When
        the plan returned without a budget meets it, the plan returned with it is that one
        or a faster one.
    optimizer : callable, optional
        ``optimizer(list_of_params)`` makes an optimizer (e.g. ``lambda ps:
        dt.optim.Adam(ps, lr=1e-3)``) whose ``step()`` is part of the traced step (its
        time, and its state in the memory).
    calibration : Calibration, optional
        Kernel throughputs; default: :func:`load_calibration` of this mesh's size, or
        built-in constants.
    candidates : dict of str to list of placements, optional
        Candidate placements for some tensors (default: every legal Replicate / Shard(d)
        per mesh dim, :func:`candidate_placements`).
    search_inputs : bool
    top_k : int
        Solutions of each round's cost table that are traced.
    pairs : int
        Most improving single moves whose pairwise interactions are traced per round.
    rounds : int
        Rounds at most.
    solver : {"auto", "milp", "bnb"}
    fit_step : bool
        Before searching, run the step in up to four layouts and refit the calibration's
        compute scale and fixed costs per op entry and per collective to their measured
        times (see the module docstring; the plan's ``step_fit``); only layouts whose
        predicted peak fits ``memory_budget`` run. Only on a real mesh of more than one rank:
        ignored on an :class:`~dtensor.AbstractMesh` (nothing runs there) and on one rank
        (no collective to tell apart). Off by default: on a quiet machine the calibration as
        it is ranked strategies better than a fit to a few noisy steps (BENCHMARKS.md); the
        fit helps where the machine's load differs from the calibration's.
    fit_repeat : int
        Timing samples per layout of ``fit_step`` (each layout runs ``fit_repeat + 1``
        steps, the first a warm-up).
    pipeline : dtensor.pipelining.PipelineOptions, optional
        Also price pipelined and context-parallel variants of every traced assignment (the
        pipeline degrees, micro-batch counts, schedules and ring-attention degrees of the
        options, their ranks taken from mesh dim 0; see
        :class:`~dtensor.pipelining.PipelineOptions`) and return the fastest (assignment,
        variant) that fits ``memory_budget``: the plan's :attr:`~ShardingPlan.pipeline`
        records the variant. The rounds then search without the budget (the budget is
        met by the variant). Pure arithmetic on the traces: Local on an AbstractMesh.

    Returns
    -------
    ShardingPlan

    Raises
    ------
    ArgumentError
        When no plan's predicted peak fits ``memory_budget`` (the message names the
        smallest predicted peak and its placements), for a ``memory_budget`` that is NaN,
        infinite or not > 0, or for bad options.
    DTypeError
        A ``memory_budget`` that is not a number (``"2GB"``).
    """
    if top_k < 1 or rounds < 1 or pairs < 0 or fit_repeat < 1:
        raise ArgumentError(f"auto_shard: top_k={top_k}, rounds={rounds}, "
                            f"fit_repeat={fit_repeat} must be >= 1 and pairs={pairs} >= 0")
    _check_budget(memory_budget)
    if pipeline is not None and not (callable(getattr(pipeline, "variants", None))
                                     and callable(getattr(pipeline, "price", None))):
        raise ArgumentError(f"auto_shard: pipeline={pipeline!r} must be a "
                            "dt.pipelining.PipelineOptions")
    backend = ("milp" if has_milp() else "bnb") if solver == "auto" else solver
    if backend not in ("milp", "bnb"):
        raise ArgumentError(f"auto_shard: unknown solver {solver!r}; use auto, milp or bnb")
    cal = calibration or load_calibration(ranks=mesh.size()) or Calibration()
    given = dict(candidates or {})
    replicated = (Replicate(),) * mesh.ndim
    arrays = {n: _global(v) for n, v in params.items()}
    choices: dict[str, list[Layout]] = {}
    start: list[int] = []
    for name, a in arrays.items():
        first = tuple(params[name].placements) if isinstance(params[name], DTensor) else (
            replicated)
        options = [_layout(c, name, mesh) for c in given[name]] if name in given else (
            candidate_placements(a.shape, mesh.shape))
        if first not in options:
            options.insert(0, first)
        choices[name] = options
        start.append(options.index(first))
    searched, fixed = {}, {}
    for name, v in inputs.items():
        if (isinstance(v, DTensor) and not isinstance(v, AbstractDTensor)) or not hasattr(
                v, "shape"):
            fixed[name] = v
            continue
        a = as_array(v)
        searched[name] = a
        if name in given:
            options = [_layout(c, name, mesh) for c in given[name]]
        elif search_inputs and a.ndim:
            options = candidate_placements(a.shape, mesh.shape, dims=(0,))
        else:
            options = [replicated]
        if replicated not in options:
            options.insert(0, replicated)
        choices[name] = options
        start.append(options.index(replicated))
    search = _Search(step_fn, arrays, searched, mesh, cal, optimizer, choices, fixed,
                     memory_budget)
    base = tuple(start)
    step_fit = None
    if fit_step and not isinstance(mesh, AbstractMesh) and mesh.size() > 1:
        step_fit = search.fit(base, fit_repeat)
    search.evaluate(base, "start")
    if pipeline is not None:
        search.budget = None
        search.rounds(base, rounds, top_k, pairs, backend, None)
        return _with_pipeline(search, pipeline, memory_budget, arrays, searched, backend,
                              step_fit)
    problem = search.rounds(base, rounds, top_k, pairs, backend, memory_budget)
    if memory_budget is not None:
        # The rounds under a budget prune with the cost table's estimates of memory and may
        # not reach what the rounds without one reach (the plan returned without a budget):
        # those run too (sharing every trace), so a budget that plan meets returns it or a
        # faster one.
        search.rounds(base, rounds, top_k, pairs, backend, None)
        search.budget = memory_budget
    best = search.best()
    if best is None:
        smallest = solve(Problem(problem.memory, problem.pair_memory, problem.memory,
                                 problem.pair_memory, None, problem.base_memory), 1, backend)
        if smallest:
            search.evaluate(smallest[0].choice, "min-memory")
        best = search.best()
        if best is None:
            low = min(search.seen, key=lambda k: search.seen[k].peak_bytes)
            where = ", ".join(f"{n}: {placement_list(p)}" for n, p in search.layouts(low).items()
                              if p != replicated) or "all replicated"
            raise ArgumentError(
                f"auto_shard: no plan fits memory_budget={memory_budget} bytes per rank; the "
                f"smallest plan found has a predicted peak of {search.seen[low].peak_bytes} "
                f"bytes ({where}) on mesh {tuple(mesh.shape)}")
    return _make_plan(search, best, arrays, searched, memory_budget, backend, mesh,
                      search.cal, step_fit)


def _base(p: Prediction, layouts: Mapping[str, Layout], params: Mapping[str, Any],
          inputs: Mapping[str, Any], mesh: Any) -> tuple[dict[str, float], int]:
    """A traced assignment's figures as :meth:`PipelineOptions.price` takes them, and the
    samples per rank (dim 0 of the largest input, as placed; its tokens: every element of
    an integer input, token ids, else all but the last dim, a token's features)."""
    batch, tokens = 1, 1
    sized = [(a.size, n) for n, a in inputs.items() if getattr(a, "ndim", 0)]
    if sized:
        name = max(sized)[1]
        local = max_local_shape(tuple(inputs[name].shape), tuple(mesh.shape), layouts[name])
        # token ids (integers): one token each; features: the last dim is a token's
        ids = np.issubdtype(np.dtype(inputs[name].dtype), np.integer)
        batch, tokens = local[0], math.prod(local if ids or len(local) < 2 else local[:-1])
    first = next(iter(params.values()), None)
    itemsize = np.dtype(first.dtype).itemsize if first is not None else 4
    return ({"forward_s": p.phases.get("forward", 0.0),
             "backward_s": p.phases.get("backward", 0.0),
             "optimizer_s": p.phases.get("optimizer", 0.0),
             "persistent_bytes": p.persistent_bytes, "activation_bytes": p.activation_bytes,
             "peak_bytes": p.peak_bytes, "attention_s": p.attention_s,
             "attention_calls": p.attention_calls, "attention_kv_bytes": p.attention_kv_bytes,
             "tokens": tokens, "itemsize": itemsize}, batch)


def _with_pipeline(search: _Search, pipeline: Any, budget: float | None,
                   arrays: Mapping[str, Any], searched: Mapping[str, Any], backend: str,
                   step_fit: StepFit | None) -> ShardingPlan:
    """The fastest (traced assignment, pipeline variant) within ``budget``."""
    cal = search.cal
    if cal.p2p:
        p2p = (float(cal.p2p["alpha_s"]), float(cal.p2p["beta_bytes_per_s"]))
    else:
        model = cal.model() if cal.cost_model else default_cost_model()
        p2p = (float(model.alpha_s), float(model.beta_bytes_per_s))
    dim0 = int(search.mesh.shape[0])
    priced: dict[tuple[int, ...], list[dict[str, Any]]] = {}
    for key, pred in search.seen.items():
        base, batch = _base(pred, search.layouts(key), arrays, searched, search.mesh)
        rows = []
        for var in pipeline.variants(dim0, batch):
            row = {**var, **pipeline.price(var, base, p2p)}
            row["fits"] = budget is None or row["peak_bytes"] <= budget
            rows.append(row)
        priced[key] = sorted(rows, key=lambda r: r["time_s"])
    fitting = [(r["time_s"], key, i) for key, rows in priced.items()
               for i, r in enumerate(rows) if r["fits"]]
    if not fitting:
        low = min(((r["peak_bytes"], key, r) for key, rows in priced.items() for r in rows),
                  key=lambda t: t[0], default=None)
        what = "no variant" if low is None else (
            f"the smallest has a predicted peak of {low[0]} bytes (pp {low[2]['pp']}, "
            f"{low[2]['microbatches']} micro-batches, cp {low[2]['cp']})")
        raise ArgumentError(f"auto_shard: no plan or pipeline variant fits memory_budget="
                            f"{budget} bytes per rank on mesh {tuple(search.mesh.shape)}; "
                            f"{what}")
    _, best, i = min(fitting, key=lambda t: (t[0], t[1], t[2]))
    search.budget = budget
    return _make_plan(search, best, arrays, searched, budget, backend, search.mesh, cal,
                      step_fit, pipeline=priced[best][i], pipeline_candidates=priced[best])


def _make_plan(search: Any, best: Any, arrays: Any, searched: Any, budget: int | None,
               backend: str, mesh: Any, cal: Calibration, step_fit: Any, **pipeline: Any
               ) -> ShardingPlan:
    """The plan of assignment ``best``, every priced assignment its candidate table
    (fastest first). **Local**."""
    table = sorted(
        (Candidate(search.layouts(k), p, tuple(search.sources[k]), search.fits(p))
         for k, p in search.seen.items()),
        key=lambda c: c.prediction.time_s)
    layouts = search.layouts(best)
    return ShardingPlan(
        placements={n: layouts[n] for n in arrays},
        input_placements={n: layouts[n] for n in searched},
        prediction=search.seen[best], candidates=table, memory_budget=budget,
        solver=backend, mesh=mesh, calibration=cal, step_fit=step_fit, **pipeline)
