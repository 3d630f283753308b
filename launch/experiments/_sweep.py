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

:func:`run_train_sweep` measures training steps (forward + backward + optimizer) of the
training models of :mod:`launch.examples._training` under their strategies (``local``,
``dp``, ``tp``, ``2d``) and reports per strategy:

- ``step_us`` and ``phase_us`` (forward, backward, optimizer): medians on the slowest rank
  (each sample starts after a barrier);
- ``comm``: per phase, collectives and bytes by kind (CommDebugMode, this rank; the
  optimizer phase includes ``clip_grad_norm_``'s all-reduce of the norm);
- ``predicted_comm_us``: per phase, the cost model's prediction of the collectives that
  :func:`dtensor.debug.explain` traces for the forward and the backward (dispatched ops'
  inputs and backward's gradient moves); explicit redistributes of the forward (TP's
  all-reduce after the row-parallel matmul) are outside explain's trace and not priced,
  nor is the optimizer phase's norm reduction (None);
- ``peak_bytes``: peak allocated bytes per rank during one step (allocator stats);
- ``loss_error``: the first step's loss against the same step on local tensors.
"""

from __future__ import annotations

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
from launch.examples._training import TrainModel, make_optimizer, mesh_for, place

__all__ = [
    "Model",
    "all_strategies",
    "attention_block",
    "format_table",
    "format_train_table",
    "mlp_block",
    "run_sweep",
    "run_train_sweep",
    "save_png",
    "standard_strategies",
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
) -> list[dict[str, Any]]:
    """Run ``model`` under every strategy on the same global data. **Collective**.

    Every rank draws the same inputs from ``seed``; each result is :func:`run_one`'s dict
    plus ``name``. Strategies whose placements are illegal for the inputs are reported with
    an ``error`` field instead of measurements.
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
        results.append({"name": name, **result})
    return results


def format_table(results: Sequence[Mapping[str, Any]]) -> str:
    """The results as an aligned text table, fastest first. **Local**."""
    head = ("strategy", "time us", "model us", "collectives", "comm bytes", "peak KiB", "max err")
    rows = [head]
    ok = sorted((r for r in results if "error" not in r), key=lambda r: r["time_us"])
    for r in ok:
        kinds = ", ".join(f"{v['count']} {k}" for k, v in r["comm"].items()) or "none"
        rows.append(
            (
                r["name"],
                f"{r['time_us']:.1f}",
                f"{r['predicted_comm_us']:.1f}",
                kinds,
                str(r["comm_bytes"]),
                f"{max(r['peak_bytes']) / 1024:.1f}",
                f"{r['max_error']:.1e}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines += [f"{r['name']}: not run ({r['error']})" for r in results if "error" in r]
    lines.append(
        "time us: median forward, slowest rank; model us: the cost model's prediction of the "
        "forward's collectives; peak KiB: largest over ranks"
    )
    return "\n".join(lines)


def save_png(results: Sequence[Mapping[str, Any]], path: str) -> bool:
    """Bar chart of measured time and predicted communication per strategy. **Local**.

    Returns False (and writes nothing) when matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ok = [r for r in results if "error" not in r]
    names = [r["name"] for r in ok]
    pos = np.arange(len(ok))
    fig, ax = plt.subplots(figsize=(max(6, len(ok) * 1.2), 4))
    ax.bar(pos - 0.2, [r["time_us"] for r in ok], 0.4, label="measured forward (us)")
    ax.bar(pos + 0.2, [r["predicted_comm_us"] for r in ok], 0.4, label="model: comm (us)")
    ax.set_xticks(pos, names, rotation=30, ha="right")
    ax.legend()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return True


# -- training steps -------------------------------------------------------------------------------
PHASES = ("forward", "backward", "optimizer")


class _Step:
    """One training step of a model under a strategy, split into its phases."""

    def __init__(self, model: TrainModel, strategy: str, mesh: dt.DeviceMesh | None,
                 optimizer: str, clip: float) -> None:
        self.model = model
        self.params = place(model, strategy, mesh, model.init())
        self.batch = place(model, strategy, mesh, model.batch(0), batch=True)
        self.opt = make_optimizer(optimizer, list(self.params.values()), 1e-3)
        self.clip = clip
        self.loss: Any = None

    def forward(self) -> None:
        self.opt.zero_grad()
        self.loss = self.model.loss(self.params, self.batch)

    def backward(self) -> None:
        self.loss.backward()

    def optimizer(self) -> None:
        dt.nn.utils.clip_grad_norm_(list(self.params.values()), self.clip)
        self.opt.step()

    def run(self) -> None:
        self.forward()
        self.backward()
        self.optimizer()


def _loss_of(loss: Any) -> float:
    return float(loss.full_tensor().item()) if isinstance(loss, dt.DTensor) else loss.item()


def _predicted_step_us(step: _Step) -> dict[str, float | None]:
    """Cost-model microseconds per phase of the collectives explain traces for one step."""
    traced = explain(lambda: (step.forward(), step.backward()))
    out: dict[str, float | None] = {"forward": 0.0, "backward": 0.0, "optimizer": None}
    for o in traced.ops:
        out[o.phase] += sum(c.seconds for c in o.collectives if c.communicates) * 1e6
    step.optimizer()
    return out


def run_train_one(model: TrainModel, strategy: str, *, optimizer: str = "sgd",
                  clip: float = 1.0, repeat: int = 5) -> dict[str, Any]:
    """Measure training steps of ``model`` under ``strategy`` (see the module docstring for
    the fields). **Collective**."""
    comm = MPI.COMM_WORLD
    mesh = mesh_for(strategy)
    step = _Step(model, strategy, mesh, optimizer, clip)
    step.forward()
    reference = _Step(model, "local", None, optimizer, clip)
    reference.forward()
    loss_error = abs(_loss_of(step.loss) - reference.loss.item())
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
    peak = dt.memory_stats()["peak_allocated_bytes"] - base
    samples: dict[str, list[float]] = {p: [] for p in ("step", *PHASES)}
    for _ in range(repeat):
        comm.Barrier()
        t0 = time.perf_counter()
        step.forward()
        t1 = time.perf_counter()
        step.backward()
        t2 = time.perf_counter()
        step.optimizer()
        t3 = time.perf_counter()
        for name, dt_s in zip(samples, (t3 - t0, t1 - t0, t2 - t1, t3 - t2)):
            samples[name].append(dt_s * 1e6)
    medians = {k: comm.allreduce(statistics.median(v), op=MPI.MAX) for k, v in samples.items()}
    return {
        "name": strategy,
        "mesh": None if mesh is None else list(mesh.shape),
        "step_us": medians["step"],
        "phase_us": {p: medians[p] for p in PHASES},
        "predicted_comm_us": _predicted_step_us(step),
        "comm": comm_by_phase,
        "comm_count": {p: sum(v["count"] for v in c.values()) for p, c in comm_by_phase.items()},
        "comm_bytes": {p: sum(v["bytes"] for v in c.values()) for p, c in comm_by_phase.items()},
        "peak_bytes": comm.allgather(int(peak)),
        "loss_error": comm.allreduce(loss_error, op=MPI.MAX),
    }


def run_train_sweep(model: TrainModel, strategies: Sequence[str], **kwargs: Any
                    ) -> list[dict[str, Any]]:
    """:func:`run_train_one` for every strategy, in order. **Collective**."""
    return [run_train_one(model, s, **kwargs) for s in strategies]


def format_train_table(results: Sequence[Mapping[str, Any]]) -> str:
    """The training results as an aligned text table, in run order. **Local**."""
    head = ("strategy", "step us", "fwd us", "bwd us", "opt us", "collectives fwd/bwd/opt",
            "bytes fwd/bwd/opt", "model us fwd/bwd", "peak KiB", "loss err")
    rows = [head]
    for r in results:
        kinds = " / ".join(
            ", ".join(f"{v['count']} {k}" for k, v in r["comm"][p].items()) or "none"
            for p in PHASES
        )
        pred = r["predicted_comm_us"]
        rows.append((
            r["name"], f"{r['step_us']:.0f}",
            *(f"{r['phase_us'][p]:.0f}" for p in PHASES), kinds,
            "/".join(str(r["comm_bytes"][p]) for p in PHASES),
            f"{pred['forward']:.1f}/{pred['backward']:.1f}",
            f"{max(r['peak_bytes']) / 1024:.1f}", f"{r['loss_error']:.1e}",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append(
        "us: median per step and per phase, slowest rank; collectives and bytes: this rank, "
        "per phase (opt: clip_grad_norm_ + the optimizer step); model us: the cost model's "
        "prediction of the collectives explain traces in forward and backward (dispatched "
        "ops' inputs, gradient moves; not explicit redistributes); peak KiB: largest over "
        "ranks"
    )
    return "\n".join(lines)
