"""Sharding-strategy sweeps: run one model under several placements and measure each.

This module owns the models (an MLP block and a single-head self-attention block, written
with ``dt`` ops so the same code runs on any placements), the candidate strategies (named
standard layouts, or every legal combination for small cases) and :func:`run_sweep`, which
runs every strategy on the real job and reports per strategy:

- ``time_us``: median microseconds of one forward pass on the slowest rank (each sample
  starts after a barrier); a forward that ends in a ``Partial`` output includes the
  reduction to ``Replicate`` (a pending sum is unfinished work);
- ``comm``: collectives and bytes by kind (:class:`dtensor.debug.CommDebugMode`, this rank);
- ``predicted_comm_us``: the cost model's prediction, the sum of the predicted times of the
  collectives the strategy issues (from :func:`dtensor.debug.explain` of the forward), to
  put beside the measurement;
- ``peak_bytes``: peak allocated bytes per rank during one forward (allocator stats);
- ``max_error``: the largest absolute difference from numpy on the same global data.

:func:`run_train_sweep` measures training steps (forward + backward + optimizer) of a
model family (:mod:`launch.experiments._families`: the training models of
:mod:`launch.examples._training` or a user's model, under ``local``, ``dp``, ``tp``, ``2d``;
or a family registered with its own strategies and predictor) and reports per strategy:

- ``mesh``: the strategy's mesh shape (None for ``local``);
- ``step_us`` and ``phase_us`` (forward, backward, optimizer): medians on the slowest rank
  (each sample starts after a barrier);
- ``comm``: per phase, collectives and bytes by kind (CommDebugMode, this rank; the
  optimizer phase includes ``clip_grad_norm_``'s all-reduce of the norm);
- ``predicted_comm_us``: per phase, the cost model's prediction of the collectives that
  :func:`dtensor.debug.explain` traces for the forward and the backward (dispatched ops'
  inputs, explicit redistributes such as TP's all-reduce after the row-parallel matmul,
  and backward's gradient moves); the optimizer phase is not traced (None) (the family's
  predictor: :meth:`~launch.experiments._families.Family.predict`);
- ``predicted_step_us``: the predictor's price of the whole step, None when it prices
  collectives only (the training models' predictor);
- ``peak_bytes``: peak allocated bytes per rank during one step (allocator stats);
- ``peak_with_state_bytes``: the same peak per rank counted from before the model was
  built (parameters, gradients, optimizer state and batch included), and
  ``predicted_peak_bytes``, the predictor's figure of it on the largest rank (None when not
  predicted);
- ``loss_error``: the first step's loss against the same step on local tensors.

When the predictor prices whole steps, :func:`train_spearman` gives the rank correlation of
predicted and measured steps and :func:`predicted_choice` the strategy the predictor picks
(the smallest predicted step whose predicted peak fits a memory budget) against the best
measured; :func:`save_train_prediction_png` draws predicted against measured.

:func:`run_auto_sweep` sets predicted against measured step time: it runs
:func:`dtensor.auto_shard` on a training model, then measures the plan it chose, the named
layouts of the family (replicated, dp, tp; 2d on a 2-D mesh) and assignments spread over the range of the search's table
(at least ``count`` in all), each with :func:`dtensor.autoshard.predict_step`'s prediction
beside its measurement (``step_us``, ``peak_bytes``: the step's peak allocated bytes above
what was allocated before its parameters were made, slowest rank; ``loss_error``). It
reports the Spearman rank correlation of predicted and measured times, how far the chosen
plan is from the best measured one, and a plan searched under a memory budget with its
measured peak. :func:`save_png`, :func:`save_train_png` and :func:`save_prediction_png`
draw each mode's chart (or say that matplotlib is missing).
"""

from __future__ import annotations

import gc
import itertools
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from mpi4py import MPI

import dtensor as dt
from dtensor.debug import explain
from launch.bench._common import fmt, table
from launch.bench._common import save_png as save_chart
from launch.examples._training import TrainModel, loss_value, make_optimizer
from launch.experiments._families import (
    PHASES,
    Family,
    FunctionalFamily,
    FunctionalStep,
    Step,
)

__all__ = [
    "Model",
    "all_strategies",
    "attention_block",
    "choice_line",
    "format_auto_table",
    "format_table",
    "format_train_table",
    "mlp_block",
    "predicted_choice",
    "run_auto_sweep",
    "run_sweep",
    "run_train_sweep",
    "save_png",
    "save_prediction_png",
    "save_train_png",
    "save_train_prediction_png",
    "spearman",
    "standard_strategies",
    "train_spearman",
]

R, S = dt.Replicate(), dt.Shard
Strategy = Mapping[str, Sequence[dt.Placement]]


@dataclass(frozen=True)
class Model:
    """A model for sweeps.

    Attributes
    ----------
    name : str
    shapes : mapping of str to tuple
        Global shape of every input (activations and parameters), in argument order.
    forward : callable
        ``forward(**inputs)`` on DTensors (or local tensors), built from ``dt`` ops.
    reference : callable
        ``reference(**arrays)``: the same computation in numpy.
    """

    name: str
    shapes: Mapping[str, tuple[int, ...]]
    forward: Callable[..., Any]
    reference: Callable[..., np.ndarray]


def _mlp(x: Any, w1: Any, w2: Any) -> Any:
    return (x @ w1).relu() @ w2


def _mlp_np(x: np.ndarray, w1: np.ndarray, w2: np.ndarray) -> np.ndarray:
    return np.maximum(x @ w1, 0) @ w2


def mlp_block(batch: int = 16, dim: int = 32, hidden: int = 64) -> Model:
    """``relu(x @ w1) @ w2`` with ``x (batch, dim)``, ``w1 (dim, hidden)``, ``w2 (hidden, dim)``.
    **Local**."""
    shapes = {"x": (batch, dim), "w1": (dim, hidden), "w2": (hidden, dim)}
    return Model("mlp", shapes, _mlp, _mlp_np)


def _attention(x: Any, wq: Any, wk: Any, wv: Any, wo: Any) -> Any:
    q, k, v = x @ wq, x @ wk, x @ wv
    scores = (q @ k.T) * (1.0 / math.sqrt(q.shape[-1]))
    return (dt.softmax(scores, dim=-1) @ v) @ wo


def _attention_np(x, wq, wk, wv, wo) -> np.ndarray:
    q, k, v = x @ wq, x @ wk, x @ wv
    s = (q @ k.T) * np.float32(1.0 / math.sqrt(q.shape[-1]))
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return ((e / e.sum(axis=-1, keepdims=True)) @ v) @ wo


def attention_block(seq: int = 16, dim: int = 32) -> Model:
    """Single-head self-attention ``softmax(q k^T / sqrt(d)) v`` then an output projection,
    on ``x (seq, dim)`` with four ``(dim, dim)`` weights. **Local**."""
    shapes = {"x": (seq, dim), **{w: (dim, dim) for w in ("wq", "wk", "wv", "wo")}}
    return Model("attention", shapes, _attention, _attention_np)


def standard_strategies(model: Model, mesh_ndim: int) -> dict[str, dict[str, list]]:
    """Named layouts of ``model``'s inputs for a 1-D or 2-D mesh. **Local**.

    ``replicated``; ``data-parallel`` (activations' first dim sharded over every mesh dim,
    weights replicated); ``tensor-parallel`` (Megatron: first weight(s) column-, last
    weight row-sharded over every mesh dim, activations replicated); on a 2-D mesh also
    ``2-D dp x tp`` (data-parallel over mesh dim 0, tensor-parallel over mesh dim 1).
    """
    col, row = ("w1",), ("w2",)
    if model.name == "attention":
        col, row = ("wq", "wk", "wv"), ("wo",)

    def layout(x: list, c: list, r: list) -> dict[str, list]:
        out = {"x": x}
        out.update({w: c for w in col})
        out.update({w: r for w in row})
        return out

    def every(p: dt.Placement) -> list:
        return [p] * mesh_ndim

    out = {
        "replicated": layout(every(R), every(R), every(R)),
        "data-parallel": layout(every(S(0)), every(R), every(R)),
        "tensor-parallel": layout(every(R), every(S(1)), every(S(0))),
    }
    if mesh_ndim == 2:
        out["2-D dp x tp"] = layout([S(0), R], [R, S(1)], [R, S(0)])
    return out


def all_strategies(model: Model, mesh_ndim: int, limit: int = 64) -> dict[str, dict[str, list]]:
    """Every combination of ``R`` / ``S(d)`` per input and mesh dim, at most ``limit``.
    **Local**. Names are the placements, e.g. ``x=S(0) w1=R w2=S(1)``."""
    choices = {}
    for name, shape in model.shapes.items():
        one = [R, *(S(d) for d in range(len(shape)))]
        choices[name] = list(itertools.product(one, repeat=mesh_ndim))
    out = {}
    for combo in itertools.islice(itertools.product(*choices.values()), limit):
        strategy = {n: list(p) for n, p in zip(choices, combo)}
        label = " ".join(f"{n}={','.join(p.short() for p in pl)}" for n, pl in strategy.items())
        out[label] = strategy
    return out


def _comm_summary(mode: dt.debug.CommDebugMode) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for rec in mode.records:
        entry = out.setdefault(rec.kind, {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += rec.nbytes
    return out


def _forward(model: Model, inputs: Mapping[str, Any], mesh: dt.DeviceMesh) -> Any:
    """The forward pass, finished: a Partial output is reduced to Replicate."""
    out = model.forward(**inputs)
    if any(p.is_partial() for p in out.placements):
        out = out.redistribute(mesh, [R if p.is_partial() else p for p in out.placements])
    return out


def _predicted_us(model: Model, inputs: Mapping[str, Any], mesh: dt.DeviceMesh) -> float:
    """Cost-model seconds (as us) of every collective one forward issues."""
    traced = explain(model.forward, **inputs)
    seconds = sum(c.seconds for c in traced.collectives())
    out = traced.result
    if any(p.is_partial() for p in out.placements):
        final = [R if p.is_partial() else p for p in out.placements]
        seconds += sum(c.seconds for c in explain(out, final).collectives())
    return seconds * 1e6


def run_one(
    model: Model,
    strategy: Strategy,
    mesh: dt.DeviceMesh,
    arrays: Mapping[str, np.ndarray],
    expected: np.ndarray,
    *,
    repeat: int = 5,
    number: int = 3,
) -> dict[str, Any]:
    """Measure one strategy (see the module docstring for the fields). **Collective**."""
    comm = MPI.COMM_WORLD
    inputs = {
        n: dt.distribute_tensor(arrays[n], mesh, list(strategy[n]), src_data_rank=None)
        for n in model.shapes
    }
    out = _forward(model, inputs, mesh)  # warm the caches
    max_error = float(np.max(np.abs(out.full_tensor().numpy() - expected), initial=0.0))
    del out
    with dt.debug.CommDebugMode() as mode:
        _forward(model, inputs, mesh)
    dt.reset_peak_memory_stats()
    base = dt.memory_stats()["allocated_bytes"]
    _forward(model, inputs, mesh)
    peak = dt.memory_stats()["peak_allocated_bytes"] - base
    samples = []
    for _ in range(repeat):
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(number):
            _forward(model, inputs, mesh)
        samples.append((time.perf_counter() - start) / number * 1e6)
    return {
        "strategy": {n: [p.short() for p in pl] for n, pl in strategy.items()},
        "time_us": comm.allreduce(statistics.median(samples), op=MPI.MAX),
        "predicted_comm_us": _predicted_us(model, inputs, mesh),
        "comm": _comm_summary(mode),
        "comm_count": mode.get_total_counts(),
        "comm_bytes": mode.get_total_bytes(),
        "peak_bytes": comm.allgather(int(peak)),
        "max_error": comm.allreduce(max_error, op=MPI.MAX),
    }


def run_sweep(
    model: Model,
    strategies: Mapping[str, Strategy],
    mesh: dt.DeviceMesh,
    *,
    seed: int = 0,
    repeat: int = 5,
    number: int = 3,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Run ``model`` under every strategy on the same global data. **Collective**.

    Every rank draws the same inputs from ``seed``; each result is :func:`run_one`'s dict
    plus ``name`` and ``mesh`` (the mesh's shape). Strategies whose placements are illegal
    for the inputs are reported with an ``error`` field instead of measurements.
    ``progress(message)`` is called after each strategy.
    """
    rng = np.random.default_rng(seed)
    arrays = {
        n: (rng.standard_normal(s) / math.sqrt(s[0])).astype(np.float32)
        for n, s in model.shapes.items()
    }
    expected = model.reference(**arrays)
    results = []
    for name, strategy in strategies.items():
        try:
            result = run_one(model, strategy, mesh, arrays, expected, repeat=repeat, number=number)
        except dt.errors.DTensorError as exc:
            result = {
                "strategy": {n: [p.short() for p in pl] for n, pl in strategy.items()},
                "error": str(exc),
            }
        results.append({"name": name, "mesh": list(mesh.shape), **result})
        if progress is not None:
            progress(f"{name} on mesh {tuple(mesh.shape)}: " + (
                "not run" if "error" in result else f"{result['time_us']:.0f} us per forward"))
    return results


def format_table(results: Sequence[Mapping[str, Any]]) -> str:
    """The results as an aligned text table, fastest first (a ``mesh`` column when the
    strategies ran on different meshes). **Local**."""
    meshes = {tuple(r.get("mesh", ())) for r in results}
    head = ("strategy", *(("mesh",) if len(meshes) > 1 else ()), "time us", "model us",
            "collectives", "comm bytes", "peak KiB", "max err")
    rows = []
    for r in sorted((r for r in results if "error" not in r), key=lambda r: r["time_us"]):
        kinds = ", ".join(f"{v['count']} {k}" for k, v in r["comm"].items()) or "none"
        mesh = (str(tuple(r["mesh"])),) if len(meshes) > 1 else ()
        rows.append((r["name"], *mesh, f"{r['time_us']:.1f}", f"{r['predicted_comm_us']:.1f}",
                     kinds, str(r["comm_bytes"]), f"{max(r['peak_bytes']) / 1024:.1f}",
                     f"{r['max_error']:.1e}"))
    notes = [f"{r['name']}: not run ({r['error']})" for r in results if "error" in r]
    notes.append("time us: median forward, slowest rank; model us: the cost model's prediction "
                 "of the forward's collectives; peak KiB: largest over ranks")
    return table(head, rows, notes=notes)


def save_png(results: Sequence[Mapping[str, Any]], path: str) -> bool:
    """Bar chart of measured time and predicted communication per strategy. **Local**.

    Returns False (writes nothing, and says so) when matplotlib is not installed.
    """
    ok = [r for r in results if "error" not in r]

    def draw(plt: Any) -> Any:
        pos = np.arange(len(ok))
        fig, ax = plt.subplots(figsize=(max(6, len(ok) * 1.2), 4))
        ax.bar(pos - 0.2, [r["time_us"] for r in ok], 0.4, label="measured forward (us)")
        ax.bar(pos + 0.2, [r["predicted_comm_us"] for r in ok], 0.4, label="model: comm (us)")
        ax.set_xticks(pos, [r["name"] for r in ok], rotation=30, ha="right")
        ax.legend()
        return fig

    return save_chart(path, draw)


# -- training steps -------------------------------------------------------------------------------
def _as_family(model: Family | TrainModel) -> Family:
    return FunctionalFamily(model) if isinstance(model, TrainModel) else model


def _phase_sample(step: Step) -> tuple[float, ...]:
    """Microseconds of one step and of each phase on this rank, after a barrier."""
    MPI.COMM_WORLD.Barrier()
    t0 = time.perf_counter()
    step.forward()
    t1 = time.perf_counter()
    step.backward()
    t2 = time.perf_counter()
    step.optimizer()
    t3 = time.perf_counter()
    return tuple(v * 1e6 for v in (t3 - t0, t1 - t0, t2 - t1, t3 - t2))


def _time_steps(steps: Sequence[Step], repeat: int) -> list[dict[str, float]]:
    """Median microseconds of the whole step and of each phase of each of ``steps``, slowest
    rank; each sample starts after a barrier, and the steps take turns (one sample of each
    per pass), so a machine whose load changes slows them alike. **Collective**."""
    comm = MPI.COMM_WORLD
    keys = ("step", *PHASES)
    samples = [{k: [] for k in keys} for _ in steps]
    for _ in range(repeat):
        for step, got in zip(steps, samples):
            for k, v in zip(keys, _phase_sample(step)):
                got[k].append(v)
    return [{k: comm.allreduce(statistics.median(v), op=MPI.MAX) for k, v in got.items()}
            for got in samples]


def _prepare_train(family: Family, strategy: str, optimizer: str, clip: float,
                   reference: float) -> tuple[Step, dict[str, Any]]:
    """``strategy``'s step built and warmed, with its collectives per phase, peak memory
    and first-loss error. **Collective**."""
    comm = MPI.COMM_WORLD
    gc.collect()  # earlier strategies' models (in reference cycles) go first
    start = dt.memory_stats()["allocated_bytes"]
    step = family.build(strategy, optimizer=optimizer, clip=clip)
    step.forward()
    loss_error = abs(_step_loss(step) - reference)
    step.backward()
    step.optimizer()
    step.run()  # warm the caches
    comm_by_phase = {}
    for phase in PHASES:
        with dt.debug.CommDebugMode() as mode:
            getattr(step, phase)()
        comm_by_phase[phase] = _comm_summary(mode)
    dt.reset_peak_memory_stats()
    base = dt.memory_stats()["allocated_bytes"]
    step.run()
    peak_allocated = dt.memory_stats()["peak_allocated_bytes"]
    return step, {
        "name": strategy,
        "mesh": None if step.mesh is None else list(step.mesh.shape),
        "comm": comm_by_phase,
        "comm_count": {p: sum(v["count"] for v in c.values()) for p, c in comm_by_phase.items()},
        "comm_bytes": {p: sum(v["bytes"] for v in c.values()) for p, c in comm_by_phase.items()},
        "peak_bytes": comm.allgather(int(peak_allocated - base)),
        "peak_with_state_bytes": comm.allgather(int(peak_allocated - start)),
        "loss_error": comm.allreduce(loss_error, op=MPI.MAX),
    }


def _finish_train(family: Family, step: Step, got: dict[str, Any],
                  medians: Mapping[str, float]) -> dict[str, Any]:
    """The measured times, the family's fit to them (when it fits) and its prediction.
    **Collective** (the predictor may be)."""
    fit = getattr(family, "fit_step", None)
    if callable(fit):
        fit(got["name"], step, medians["step"])
    prediction = family.predict(got["name"], step)
    return {
        **got,
        "step_us": medians["step"],
        "phase_us": {p: medians[p] for p in PHASES},
        "predicted_comm_us": dict(prediction.comm_us),
        "predicted_step_us": prediction.step_us,
        "predicted_peak_bytes": prediction.peak_bytes,
    }


def run_train_one(model: Family | TrainModel, strategy: str, *, optimizer: str = "sgd",
                  clip: float = 1.0, repeat: int = 5, reference: float | None = None
                  ) -> dict[str, Any]:
    """Measure training steps of ``model`` (a family, or a :class:`TrainModel`) under
    ``strategy`` (see the module docstring for the fields); ``reference``: the reference
    run's first loss (default: the family's). **Collective**."""
    family = _as_family(model)
    if reference is None:
        reference = family.reference_loss(optimizer=optimizer, clip=clip)
    step, got = _prepare_train(family, strategy, optimizer, clip, reference)
    return _finish_train(family, step, got, _time_steps([step], repeat)[0])


def _step_loss(step: Step) -> float:
    """The step's loss as a float: the step's own ``loss_value()`` when it has one (a loss
    that each data-parallel rank holds for its rows), else :func:`loss_value`."""
    own = getattr(step, "loss_value", None)
    return float(own()) if callable(own) else loss_value(step.loss)


def predicted_choice(results: Sequence[Mapping[str, Any]], budget_bytes: int | None = None
                     ) -> dict[str, Any] | None:
    """The strategy a predictor chooses among the measured ones: the smallest predicted step
    among those whose predicted peak (``predicted_peak_bytes``; None fits) is at most
    ``budget_bytes`` (None: no limit), against the best measured step among those whose
    measured peak (``peak_with_state_bytes``, largest rank) fits. None when a strategy has
    no predicted step. **Local**."""
    if not results or any(r.get("predicted_step_us") is None for r in results):
        return None

    def fits(peak: int | None) -> bool:
        return budget_bytes is None or peak is None or peak <= budget_bytes

    ok = [r for r in results if fits(r.get("predicted_peak_bytes"))]
    measured_ok = [r for r in results if fits(max(r["peak_with_state_bytes"]))] or results
    best = min(measured_ok, key=lambda r: r["step_us"])
    out: dict[str, Any] = {
        "budget_bytes": budget_bytes, "best": best["name"], "best_step_us": best["step_us"],
        "excluded": [r["name"] for r in results if r not in ok]}
    if not ok:
        return {**out, "chosen": None}
    chosen = min(ok, key=lambda r: r["predicted_step_us"])
    ratio = chosen["step_us"] / best["step_us"]
    return {**out, "chosen": chosen["name"], "predicted_step_us": chosen["predicted_step_us"],
            "measured_step_us": chosen["step_us"], "over_best": ratio,
            "within_10pct": ratio <= 1.1}


def choice_line(choice: Mapping[str, Any]) -> str:
    """One line of :func:`predicted_choice`'s answer. **Local**."""
    budget = ("no memory budget" if choice["budget_bytes"] is None
              else f"memory budget {choice['budget_bytes'] / 2**20:.0f} MiB per rank")
    excluded = (f"; over the budget by prediction: {', '.join(choice['excluded'])}"
                if choice["excluded"] else "")
    if choice["chosen"] is None:
        return f"predictor's choice: none ({budget}: no strategy's predicted peak fits)"
    return (f"predictor's choice ({budget}{excluded}): {choice['chosen']} (predicted "
            f"{choice['predicted_step_us'] / 1e3:.1f} ms), measured "
            f"{choice['measured_step_us'] / 1e3:.1f} ms = {choice['over_best']:.3f} x the best "
            f"measured ({choice['best']}, {choice['best_step_us'] / 1e3:.1f} ms): "
            + ("within 10%" if choice["within_10pct"] else "NOT within 10%"))


def run_train_sweep(model: Family | TrainModel, strategies: Sequence[str] | None = None, *,
                    progress: Callable[..., None] | None = None, interleave: bool = False,
                    optimizer: str = "sgd", clip: float = 1.0, repeat: int = 5
                    ) -> list[dict[str, Any]]:
    """:func:`run_train_one` for every strategy, in order (default: the family's strategies
    at this many ranks); the reference loss is computed once. ``progress(message)`` is
    called after each strategy. With ``interleave`` every strategy's step is built and
    warmed first (all of them held at once) and then timed in turns, one sample of each per
    pass, so that a machine whose load changes slows them alike (``progress`` also says
    when each is ready, with ``step=False``). **Collective**."""
    family = _as_family(model)
    if strategies is None:
        strategies = family.strategies(MPI.COMM_WORLD.size)
    reference = family.reference_loss(optimizer=optimizer, clip=clip)
    say = progress or (lambda message, step=True: None)

    def done(r: Mapping[str, Any]) -> None:
        where = "local" if r["mesh"] is None else f"mesh {tuple(r['mesh'])}"
        say(f"{r['name']} ({where}): {r['step_us']:.0f} us per step")

    results = []
    if not interleave:
        for s in strategies:
            results.append(run_train_one(family, s, reference=reference, optimizer=optimizer,
                                         clip=clip, repeat=repeat))
            done(results[-1])
        return results
    prepared = []
    for s in strategies:
        prepared.append(_prepare_train(family, s, optimizer, clip, reference))
        say(f"{s}: built and warmed", step=False)
    say(f"timing {len(prepared)} strategies in turns, {repeat} passes", step=False)
    medians = _time_steps([step for step, _ in prepared], repeat)
    for (step, got), m in zip(prepared, medians):
        results.append(_finish_train(family, step, got, m))
        done(results[-1])
    return results


def train_spearman(results: Sequence[Mapping[str, Any]], without: Sequence[str] = ()
                   ) -> float | None:
    """Spearman rank correlation of predicted and measured steps over the strategies with a
    predicted step (less those named in ``without``), when there are at least three (else
    None). **Local**."""
    stepped = [r for r in results
               if r.get("predicted_step_us") is not None and r["name"] not in without]
    if len(stepped) < 3:
        return None
    return spearman([r["predicted_step_us"] for r in stepped], [r["step_us"] for r in stepped])


def _peak_columns(r: Mapping[str, Any]) -> tuple[str, str, str]:
    """Measured and predicted peak with the model state (MiB, largest rank) and the error."""
    meas = max(r["peak_with_state_bytes"])
    pred = r["predicted_peak_bytes"]
    err = f"{100 * (pred - meas) / meas:+.1f}%" if meas else "-"
    return f"{meas / 2**20:.2f}", f"{pred / 2**20:.2f}", err


def format_train_table(results: Sequence[Mapping[str, Any]],
                       choice: Mapping[str, Any] | None = None,
                       fitted: Sequence[str] = ()) -> str:
    """The training results as an aligned text table, in run order; when the family's
    predictor priced whole steps, a column of them and their Spearman rank correlation with
    the measured steps (also without the strategies ``fitted`` names, whose measured steps
    the predictor was fitted to); when it predicted peaks, the measured and predicted peak
    with the model state; ``choice``: :func:`predicted_choice`'s answer, as a line.
    **Local**."""
    stepped = [r for r in results if r.get("predicted_step_us") is not None]
    peaks = bool(results) and all(r.get("predicted_peak_bytes") is not None for r in results)
    head = ("strategy", "mesh", "step us", *(("pred step us",) if stepped else ()), "fwd us",
            "bwd us", "opt us", "collectives fwd/bwd/opt", "bytes fwd/bwd/opt",
            "model us fwd/bwd", "peak KiB",
            *(("peak+state MiB", "pred MiB", "peak err") if peaks else ()), "loss err")
    rows = []
    for r in results:
        kinds = " / ".join(
            ", ".join(f"{v['count']} {k}" for k, v in r["comm"][p].items()) or "none"
            for p in PHASES
        )
        pred = r["predicted_comm_us"]
        rows.append((
            r["name"], "local" if r["mesh"] is None else str(tuple(r["mesh"])),
            f"{r['step_us']:.0f}",
            *((fmt(r.get("predicted_step_us")),) if stepped else ()),
            *(f"{r['phase_us'][p]:.0f}" for p in PHASES), kinds,
            "/".join(str(r["comm_bytes"][p]) for p in PHASES),
            "/".join(fmt(pred.get(p)) for p in ("forward", "backward")),
            f"{max(r['peak_bytes']) / 1024:.1f}",
            *(_peak_columns(r) if peaks else ()), f"{r['loss_error']:.1e}",
        ))
    notes = []
    rho = train_spearman(results)
    if rho is not None:
        notes.append(f"Spearman rank correlation predicted/measured step: {rho:.3f} over "
                     f"{len(stepped)} strategies")
    if fitted:
        rest = train_spearman(results, fitted)
        notes.append(f"the predictor was fitted to the measured step of {', '.join(fitted)}; "
                     "Spearman without it: "
                     + ("- (fewer than 3 strategies)" if rest is None else
                        f"{rest:.3f} over {len(stepped) - len(fitted)} strategies"))
    if choice is not None:
        notes.append(choice_line(choice))
    if peaks:
        notes.append("peak+state MiB: the step's peak allocated bytes counted from before the "
                     "model was built (parameters, gradients, optimizer state, batch), largest "
                     "rank; pred MiB: the predictor's; peak err: (predicted - measured) / "
                     "measured")
    notes.append(
        "us: median per step and per phase, slowest rank; collectives and bytes: this rank, "
        "per phase (opt: clip_grad_norm_ + the optimizer step); model us: the cost model's "
        "prediction of the collectives explain traces in forward and backward (dispatched "
        "ops' inputs, gradient moves; not explicit redistributes); peak KiB: largest over "
        "ranks"
    )
    return table(head, rows, notes=notes)


def save_train_png(results: Sequence[Mapping[str, Any]], path: str, title: str = "") -> bool:
    """Bar chart of the training step per strategy, stacked by phase, beside the cost
    model's prediction of the forward's and backward's collectives (and of the step, when
    the family predicts steps). **Local**.

    Returns False (writes nothing, and says so) when matplotlib is not installed."""

    def draw(plt: Any) -> Any:
        pos = np.arange(len(results))
        fig, ax = plt.subplots(figsize=(max(6, len(results) * 1.3), 4))
        bottom = np.zeros(len(results))
        for phase in PHASES:
            heights = np.array([r["phase_us"][phase] for r in results])
            ax.bar(pos - 0.2, heights, 0.4, bottom=bottom, label=f"measured {phase}")
            bottom += heights
        comm = [sum(v or 0.0 for v in r["predicted_comm_us"].values()) for r in results]
        ax.bar(pos + 0.2, comm, 0.4, color="0.6", label="model: fwd+bwd collectives")
        steps = [(i, r["predicted_step_us"]) for i, r in enumerate(results)
                 if r.get("predicted_step_us") is not None]
        if steps:
            ax.scatter(*zip(*steps), marker="_", s=400, color="k", label="predicted step",
                       zorder=3)
        ax.set_xticks(pos, [r["name"] if r["mesh"] is None else
                            f"{r['name']}\n{tuple(r['mesh'])}" for r in results])
        ax.set_ylabel("us (median, slowest rank)")
        ax.set_title(title)
        ax.legend(fontsize="small")
        return fig

    return save_chart(path, draw)


def save_train_prediction_png(results: Sequence[Mapping[str, Any]], path: str, title: str = "",
                              choice: Mapping[str, Any] | None = None,
                              fitted: Sequence[str] = ()) -> bool:
    """Scatter of predicted against measured step time per strategy (the predictor's choice
    ringed; the strategies it was ``fitted`` to marked so), and of predicted against
    measured peak memory when predicted. **Local**.

    Returns False (writes nothing, and says so) when matplotlib is not installed."""
    rows = [r for r in results if r.get("predicted_step_us") is not None]
    peaks = [r for r in rows if r.get("predicted_peak_bytes") is not None]

    def panel(ax: Any, pairs: list[tuple[str, float, float]], unit: str, what: str,
              marks: Sequence[str] = ()) -> None:
        x, y = [p[1] for p in pairs], [p[2] for p in pairs]
        ax.scatter(x, y, s=24)
        for name, xi, yi in pairs:
            label = f"{name} (fitted)" if name in marks else name
            ax.annotate(label, (xi, yi), textcoords="offset points", xytext=(4, 4))
            if choice is not None and name == choice.get("chosen"):
                ax.scatter([xi], [yi], s=160, facecolors="none", edgecolors="r",
                           label="predictor's choice")
        lo, hi = min(x + y), max(x + y)
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="measured = predicted")
        ax.set_xlabel(f"predicted {what} ({unit})")
        ax.set_ylabel(f"measured {what} ({unit})")
        ax.legend(loc="best", fontsize="small")

    def draw(plt: Any) -> Any:
        n = 2 if peaks else 1
        fig, axes = plt.subplots(1, n, figsize=(6 * n, 5), squeeze=False)
        panel(axes[0][0], [(r["name"], r["predicted_step_us"] / 1e3, r["step_us"] / 1e3)
                           for r in rows], "ms", "step", fitted)
        rho, rest = train_spearman(rows), train_spearman(rows, fitted) if fitted else None
        axes[0][0].set_title(f"{title}\nstep: Spearman "
                             + ("-" if rho is None else f"{rho:.2f}")
                             + (f", {rest:.2f} without {', '.join(fitted)}"
                                if rest is not None else ""), fontsize="small")
        if peaks:
            panel(axes[0][1], [(r["name"], r["predicted_peak_bytes"] / 2**20,
                                max(r["peak_with_state_bytes"]) / 2**20) for r in peaks],
                  "MiB", "peak")
            axes[0][1].set_title("peak memory with the model state, largest rank",
                                 fontsize="small")
        fig.tight_layout()
        return fig

    return save_chart(path, draw)


# -- predicted against measured (auto_shard) --------------------------------------------------
class _ClipStep:
    """The optimizer phase of :class:`FunctionalStep` as one object: ``clip_grad_norm_`` then the
    optimizer's step (what ``auto_shard`` traces as the step's optimizer)."""

    def __init__(self, params: list, optimizer: str, clip: float) -> None:
        self.params, self.clip = params, clip
        self.opt = make_optimizer(optimizer, params, 1e-3)
        self.state = self.opt.state

    def step(self) -> None:
        dt.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.opt.step()


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman rank correlation of two sequences (ties get their average rank). **Local**."""

    def ranks(x: Sequence[float]) -> np.ndarray:
        x = np.asarray(x, float)
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x), dtype=float)
        for v in np.unique(x):
            tie = x == v
            r[tie] = r[tie].mean()
        return r

    ra, rb = ranks(a), ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def _label(layouts: Mapping[str, Sequence[dt.Placement]]) -> str:
    parts = [f"{n}={','.join(p.short() for p in pl)}" for n, pl in layouts.items()
             if any(not p.is_replicate() for p in pl)]
    return " ".join(parts) or "all replicated"


def _placed_step(model: TrainModel, mesh: dt.DeviceMesh, layouts: Mapping[str, tuple],
                 optimizer: str, clip: float, reference: float) -> tuple[FunctionalStep, dict]:
    """``model``'s step in ``layouts``, warmed, with its peak bytes and first-loss error.
    **Collective**."""
    comm = MPI.COMM_WORLD
    dt.empty_cache()
    base = dt.memory_stats()["allocated_bytes"]
    params = {n: dt.distribute_tensor(a, mesh, list(layouts[n]), src_data_rank=None)
              .requires_grad_() for n, a in model.init().items()}
    batch = {n: dt.distribute_tensor(a, mesh, list(layouts[n]), src_data_rank=None)
             for n, a in model.batch(0).items()}
    step = FunctionalStep(model, params, batch, optimizer, clip, mesh)
    step.forward()
    loss_error = abs(loss_value(step.loss) - reference)
    step.backward()
    step.optimizer()
    step.run()
    dt.reset_peak_memory_stats()
    step.run()
    peak = dt.memory_stats()["peak_allocated_bytes"] - base
    return step, {"peak_bytes": comm.allreduce(int(peak), op=MPI.MAX),
                  "loss_error": comm.allreduce(loss_error, op=MPI.MAX)}


def _time_interleaved(steps: Sequence[Step], repeat: int) -> list[float]:
    """Median microseconds of a whole step of each, slowest rank; the steps take turns
    (one sample of each per pass, each after a barrier), so a machine whose load changes
    slows them alike. **Collective**."""
    comm = MPI.COMM_WORLD
    samples: list[list[float]] = [[] for _ in steps]
    for _ in range(repeat):
        for i, step in enumerate(steps):
            comm.Barrier()
            t0 = time.perf_counter()
            step.run()
            samples[i].append((time.perf_counter() - t0) * 1e6)
    return [comm.allreduce(statistics.median(v), op=MPI.MAX) for v in samples]


def _spread(candidates: Sequence[Any], count: int) -> list[Any]:
    """``count`` candidates evenly spaced over the list (its first and last included)."""
    if len(candidates) <= count:
        return list(candidates)
    if count < 2:
        return list(candidates[:count])
    idx = sorted({round(i * (len(candidates) - 1) / (count - 1)) for i in range(count)})
    return [candidates[i] for i in idx]


def run_auto_sweep(model: Family | TrainModel, mesh: dt.DeviceMesh, *, optimizer: str = "sgd",
                   clip: float = 1.0, repeat: int = 7, count: int = 14,
                   budget_quantile: float = 0.25,
                   calibration: dt.autoshard.Calibration | None = None,
                   solver: str = "auto", fit_step: bool = False,
                   progress: Callable[..., None] | None = None) -> dict[str, Any]:
    """Predicted against measured step times (see the module docstring). **Collective**.

    ``model``: a family with a functional form (:meth:`Family.auto_model`; its
    :meth:`Family.named_layouts` are measured beside the search's plans) or a
    :class:`TrainModel`. ``budget_quantile`` picks the memory budget of the second search:
    that quantile of the predicted peaks of the first search's table; ``solver`` and
    ``fit_step`` are :func:`dtensor.auto_shard`'s. Every strategy is predicted with the
    calibration the search priced with (with ``fit_step``, the one fitted to the step; the
    layouts it was fitted to are measured again here, and the Spearman correlation is also
    given without them). ``progress(message, step=True)`` is called as the work goes on
    (``step=False`` for a line about the work under way)."""
    family = _as_family(model)
    model = family.auto_model()
    if model is None:
        raise ValueError(f"--auto: the model family {family.name!r} has no functional form "
                         "for auto_shard")
    say = progress or (lambda message, step=True: None)
    params, batch = model.init(), model.batch(0)

    def make_opt(ps: list) -> _ClipStep:
        return _ClipStep(ps, optimizer, clip)

    say("auto_shard: searching" + (" (fitting the step first)" if fit_step else ""),
        step=False)
    start = time.perf_counter()
    plan = dt.auto_shard(model.loss, params, batch, mesh, optimizer=make_opt,
                         calibration=calibration, solver=solver, fit_step=fit_step)
    search_s = time.perf_counter() - start
    say(f"auto_shard: {len(plan.candidates)} assignments traced in {search_s:.1f} s",
        step=False)
    calibration = plan.calibration
    chosen = {**plan.placements, **plan.input_placements}
    layouts: dict[str, dict[str, tuple]] = {"auto": chosen}
    for name, lay in family.named_layouts(mesh).items():
        if lay not in layouts.values():
            layouts[name] = lay
    fitted = plan.step_fit.layouts if plan.step_fit is not None else []
    for lay in fitted:
        if lay not in layouts.values():
            layouts[f"fit: {_label(lay)}"] = lay
    rest = [c for c in plan.candidates if dict(c.placements) not in layouts.values()]
    for c in _spread(rest, max(count - len(layouts), 0)):
        layouts[_label(c.placements)] = dict(c.placements)
    rng = np.random.default_rng(0)
    options = {n: dt.autoshard.candidate_placements(s, mesh.shape)
               for n, s in model.shapes.items()}
    options.update({n: dt.autoshard.candidate_placements(a.shape, mesh.shape, dims=(0,))
                    for n, a in batch.items()})
    for _ in range(100 * count):  # random assignments when the table is short
        if len(layouts) >= count:
            break
        lay = {n: o[rng.integers(len(o))] for n, o in options.items()}
        if lay not in layouts.values():
            layouts[_label(lay)] = lay
    ref_loss = family.reference_loss(optimizer=optimizer, clip=clip)
    if progress is not None and hasattr(progress, "total"):
        progress.total = len(layouts) + 1
    rows, steps = [], []
    for name, lay in layouts.items():
        pred = dt.autoshard.predict_step(model.loss, params, batch, mesh, lay,
                                         optimizer=make_opt, calibration=calibration)
        step, got = _placed_step(model, mesh, lay, optimizer, clip, ref_loss)
        steps.append(step)
        rows.append({"name": name, "placements": {n: [p.short() for p in pl]
                                                  for n, pl in lay.items()},
                     "predicted_us": pred.time_s * 1e6,
                     "predicted_phase_us": {k: v * 1e6 for k, v in pred.phases.items()},
                     "predicted_comm_us": pred.comm_s * 1e6,
                     "terms": {"entries": pred.entries, "alpha_us": pred.alpha_s * 1e6,
                               "work_us": pred.work_s * 1e6,
                               "model_comm_us": pred.model_comm_s * 1e6,
                               "collectives": pred.collectives},
                     "predicted_peak_bytes": pred.peak_bytes, **got})
        say(f"{name}: predicted {pred.time_s * 1e6:.0f} us, placed and warmed")
    say(f"timing {len(steps)} strategies, {repeat} passes", step=False)
    for r, us in zip(rows, _time_interleaved(steps, repeat)):
        r["step_us"] = us
    del steps
    measured = [r["step_us"] for r in rows]
    best = min(measured)
    others = [(r["predicted_us"], r["step_us"]) for r, lay in zip(rows, layouts.values())
              if lay not in fitted]
    peaks = sorted(c.prediction.peak_bytes for c in plan.candidates)
    budget = int(peaks[int(budget_quantile * (len(peaks) - 1))])
    budget_plan = dt.auto_shard(model.loss, params, batch, mesh, budget, optimizer=make_opt,
                                calibration=calibration, solver=solver, fit_step=False)
    blay = {**budget_plan.placements, **budget_plan.input_placements}
    bstep, bgot = _placed_step(model, mesh, blay, optimizer, clip, ref_loss)
    bgot["step_us"] = _time_interleaved([bstep], repeat)[0]
    say(f"memory budget {budget / 1024:.1f} KiB: plan {_label(blay)}")
    return {
        "model": model.name, "mesh": list(mesh.shape), "shapes": dict(model.shapes),
        "search_s": search_s, "traced": len(plan.candidates), "solver": plan.solver,
        "chosen": _label(chosen), "results": rows,
        "spearman": spearman([r["predicted_us"] for r in rows], measured),
        "spearman_unfitted": spearman(*zip(*others)) if len(others) > 1 else float("nan"),
        "unfitted_count": len(others),
        "step_fit": None if plan.step_fit is None else {
            "layouts": [_label(lay) for lay in fitted],
            "measured_us": [v * 1e6 for v in plan.step_fit.measured_s],
            "predicted_us": [v * 1e6 for v in plan.step_fit.predicted_s],
            "fitted_us": [v * 1e6 for v in plan.step_fit.fitted_s],
            "compute_scale": plan.step_fit.compute_scale,
            "entry_us": plan.step_fit.entry_s * 1e6, "sync_us": plan.step_fit.sync_s * 1e6},
        "chosen_over_best": rows[0]["step_us"] / best,
        "budget": {"bytes": budget, "plan": _label(blay),
                   "predicted_peak_bytes": budget_plan.predicted_peak_bytes,
                   "measured_peak_bytes": bgot["peak_bytes"], "step_us": bgot["step_us"],
                   "loss_error": bgot["loss_error"],
                   "respected": bgot["peak_bytes"] <= budget},
        "table": plan.table(),
    }


def format_auto_table(doc: Mapping[str, Any]) -> str:
    """:func:`run_auto_sweep`'s report as text: one row per strategy, fastest measured
    first, then the summary. **Local**."""
    head = ("strategy", "measured us", "predicted us", "pred comm us", "peak KiB",
            "pred peak KiB", "loss err")
    rows = [(r["name"][:70], f"{r['step_us']:.0f}", f"{r['predicted_us']:.0f}",
             f"{r['predicted_comm_us']:.0f}", f"{r['peak_bytes'] / 1024:.1f}",
             f"{r['predicted_peak_bytes'] / 1024:.1f}", f"{r['loss_error']:.1e}")
            for r in sorted(doc["results"], key=lambda r: r["step_us"])]
    b = doc["budget"]
    f = doc.get("step_fit")
    fit_line = "no fit to the step: the calibration as it is" if f is None else (
        f"terms fitted to the step in {len(f['layouts'])} layouts "
        f"({'; '.join(f['layouts'])}): compute x{f['compute_scale']:.2f}, "
        f"{f['entry_us']:.1f} us per op entry, "
        f"{f['sync_us']:.1f} us per collective; Spearman without those layouts: "
        f"{doc['spearman_unfitted']:.3f} over {doc['unfitted_count']} strategies")
    notes = [
        (f"auto_shard chose: {doc['chosen']} (search {doc['search_s']:.1f} s, "
         f"{doc['traced']} assignments traced, solver {doc['solver']})"),
        (f"Spearman rank correlation predicted/measured: {doc['spearman']:.3f} "
         f"over {len(doc['results'])} strategies"),
        fit_line,
        f"chosen plan measured / best measured: {doc['chosen_over_best']:.3f}",
        (f"memory budget {b['bytes'] / 1024:.1f} KiB: plan {b['plan']}, predicted peak "
         f"{b['predicted_peak_bytes'] / 1024:.1f} KiB, measured "
         f"{b['measured_peak_bytes'] / 1024:.1f} KiB: "
         f"{'respected' if b['respected'] else 'EXCEEDED'}"),
        ("measured us: median training step (forward, backward, clip_grad_norm_, optimizer), "
         "slowest rank; peak KiB: step peak above the memory in use before the parameters, "
         "largest rank"),
    ]
    return table(head, rows, notes=notes)


def save_prediction_png(docs: Sequence[Mapping[str, Any]], path: str) -> bool:
    """Scatter of predicted against measured step time, one panel per report of
    :func:`run_auto_sweep`, the chosen plan and the named layouts labelled. **Local**.

    Returns False (writes nothing, and says so) when matplotlib is not installed."""

    def draw(plt: Any) -> Any:
        fig, axes = plt.subplots(1, len(docs), figsize=(6 * len(docs), 5), squeeze=False)
        for ax, doc in zip(axes[0], docs):
            rows = doc["results"]
            x = [r["predicted_us"] / 1e3 for r in rows]
            y = [r["step_us"] / 1e3 for r in rows]
            ax.scatter(x, y, s=18)
            for r, xi, yi in zip(rows, x, y):
                if r["name"] in ("auto", "replicated", "dp", "tp", "2d"):
                    ax.annotate(r["name"], (xi, yi), textcoords="offset points",
                                xytext=(4, 4))
            lo, hi = min(x + y), max(x + y)
            ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="measured = predicted")
            ax.set_xlabel("predicted step (ms)")
            ax.set_ylabel("measured step (ms)")
            ax.set_title(f"{doc['model']} on mesh {tuple(doc['mesh'])}: Spearman "
                         f"{doc['spearman']:.2f}")
            ax.legend(loc="upper left")
        return fig

    return save_chart(path, draw)
