"""Calibration of :func:`dtensor.auto_shard`'s predictions: collectives and kernels measured
on this machine.

This module owns :class:`Calibration` (the redistribute cost model's constants per mesh dim
and the kernel throughput per op class), :func:`load_calibration` /
:meth:`Calibration.save` (the JSON file, reused between runs), :func:`fit` (the
least-squares ``seconds = alpha + work / rate`` used for both), :func:`fit_to_steps`
(``compute_scale``, ``entry_s`` and ``sync_s`` refitted to measured steps of the user's own
model) and the pricing of one traced
op's local compute (:func:`op_class`, :meth:`Calibration.kernel_seconds`). The measuring is
:mod:`dtensor.autoshard._measure`'s.

Op classes and their work measure:

=========  ===============================================  ============================
class      ops (each op record's ``cost``)                  work
=========  ===============================================  ============================
matmul     products (matmul, mm, bmm, linear, einsum...)    flops: ``2 * out * K``
nn         reductions, scans, softmax, layer_norm, losses   bytes read + written
pointwise  every other op that computes                     bytes read + written
view       views, reorderings (reshape, flip, tile...)      none (a fixed cost)
=========  ===============================================  ============================

A kernel's time is ``alpha_s + work / rate`` of its class (the work's seconds times
``compute_scale`` inside a training step); ``alpha_s`` includes the
dispatch of one op on DTensors (what dominates small ops). Each traced entry of a training
step also costs ``entry_s`` (autograd and the Python around the ops), measured on a small
training step, and each collective in it ``sync_s`` (ranks waiting for each other). The
JSON file::

    {"version": 1, "ranks": 2, "mesh_shape": [2],
     "cost_model": {...the redistribute.cost.CostModel format...},
     "kernels": {"matmul": {"alpha_s": 2e-05, "rate": 2e10}, ...},
     "entry_s": 2e-05, "sync_s": 1e-4, "compute_scale": 1.0,
     "overlap_slowdown": 1.0, "copy_rate": 5e9,
     "points": {...the measured points...}}

``overlap_slowdown`` and ``copy_rate`` (what ``fully_shard``'s steps cost beside their
collectives) are optional: a file without them loads with 1.0 and
:data:`DEFAULT_COPY_RATE`.

The default file is ``$DTENSOR_CALIBRATION`` when set (the path of a ``.json`` file,
which need not exist yet; anything else raises ``ConfigError``), else
``$XDG_CACHE_HOME/dtensor/calibration-<ranks>.json`` (``~/.cache`` without XDG_CACHE_HOME).
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from placements.errors import ConfigError
from redistribute.cost import CostModel, set_default_cost_model

from ..ops.table import OPS

__all__ = [
    "CLASSES",
    "Calibration",
    "default_path",
    "fit",
    "fit_to_steps",
    "load_calibration",
    "op_class",
]

ENV_VAR = "DTENSOR_CALIBRATION"
VERSION = 1

#: Op classes priced by their own throughput.
CLASSES = ("matmul", "nn", "pointwise", "view")

#: Kernel constants used when no calibration is given (rough figures of one CPU core).
DEFAULT_KERNELS: dict[str, dict[str, float]] = {
    "matmul": {"alpha_s": 2e-5, "rate": 2e10},
    "nn": {"alpha_s": 3e-5, "rate": 2e9},
    "pointwise": {"alpha_s": 1e-5, "rate": 4e9},
    "view": {"alpha_s": 5e-6, "rate": math.inf},
}

#: Fixed cost of one traced entry when no calibration is given.
DEFAULT_ENTRY_S = 2e-5

#: Fixed cost of one collective inside a training step when no calibration is given.
DEFAULT_SYNC_S = 2e-5

#: Bytes per second (read + written) of a large memory copy when no calibration is given.
DEFAULT_COPY_RATE = 5e9

def op_class(name: str) -> str:
    """The class (:data:`CLASSES`) whose throughput prices op ``name``: its record's
    ``cost`` (:class:`dtensor.ops.OpInfo`). **Local**.

    ``redistribute`` (a traced move) and unknown names are ``view`` (no local compute
    beyond the move, which the cost model prices)."""
    info = OPS.get(name)
    return "view" if info is None else info.cost


def _bytes(block: Any) -> int:
    if block is None:
        return 0
    shape, dtype = block
    return math.prod(shape) * np.dtype(dtype).itemsize


def op_work(name: str, local_inputs: tuple, local_outputs: tuple) -> float:
    """The work of one op call on its local blocks (see the module docstring). **Local**."""
    cls = op_class(name)
    if cls == "view":
        return 0.0
    if cls == "matmul":
        first = 1 if name == "addmm" else 0
        blocks = [b for b in local_inputs if b is not None]
        a = local_inputs[first] if len(local_inputs) > first else None
        k = a[0][-1] if a is not None and a[0] else (blocks[0][0][-1] if blocks else 1)
        out = sum(math.prod(s) for s, _ in local_outputs)
        return 2.0 * out * k
    return float(sum(_bytes(b) for b in local_inputs) + sum(_bytes(b) for b in local_outputs))


@dataclass(frozen=True)
class Calibration:
    """Measured constants of one machine and mesh shape.

    Attributes
    ----------
    cost_model : dict
        The redistribute cost model (:class:`redistribute.cost.CostModel`'s JSON format),
        per collective kind and mesh dim.
    kernels : dict
        ``{class: {"alpha_s": seconds, "rate": work per second}}`` per op class.
    ranks : int
    mesh_shape : tuple of int
    points : dict
        The measured points the constants were fitted to: ``{"collectives": {mesh dim:
        {kind: [(bytes, seconds), ...]}}, "kernels": {class: [(work, seconds), ...]}}``.
    entry_s : float
        The fixed cost of one traced entry of a training step beyond its kernel (autograd's
        recording, the backward walk, the Python around the ops): measured on a small
        training step as its time minus its kernels' predictions, per entry.
    sync_s : float
        The fixed cost of one collective inside a training step beyond the cost model's
        price (ranks reach it at different times and wait): measured on the same step,
        data-parallel.
    compute_scale : float
        Factor on the seconds of every kernel's work (``work / rate``) inside a training
        step, whose kernels do not run as the single ones measured (operands out of cache,
        small local blocks that do not run proportionally faster): 1 unless fitted to
        measured steps (:func:`fit_to_steps`).
    p2p : dict
        ``{"alpha_s": seconds, "beta_bytes_per_s": bytes per second}`` of one point-to-point
        message (a pipeline's activations, ring attention's blocks), fitted to
        :func:`dtensor.autoshard._measure.measure_p2p`'s points (``points["p2p"]``); empty
        in calibrations made before it (the pricing then takes the cost model's defaults).
    overlap_slowdown : float
        How much longer compute takes while an all-gather runs on the asynchronous
        worker thread (``fully_shard``'s prefetch) than alone: a matmul's wall seconds
        beside a stream of all-gathers over its seconds alone, the slowest rank's (at least
        1; 1 when not measured). The gather's copies and MPI's progress loop compete with
        the compute for the core and its memory bandwidth.
    copy_rate : float
        Bytes per second (read + written) of a memory copy of tens of MiB, out of the
        caches (``fully_shard`` packs its shards, copies gathered parameters out and packs
        gradients for the reduce-scatter): the kernels' pointwise rate is measured on
        operands that stay in the caches.
    """

    cost_model: dict[str, Any] = field(default_factory=dict)
    kernels: dict[str, dict[str, float]] = field(default_factory=lambda: dict(DEFAULT_KERNELS))
    ranks: int = 1
    mesh_shape: tuple[int, ...] = ()
    points: dict[str, Any] = field(default_factory=dict)
    entry_s: float = DEFAULT_ENTRY_S
    sync_s: float = DEFAULT_SYNC_S
    compute_scale: float = 1.0
    p2p: dict[str, float] = field(default_factory=dict)
    overlap_slowdown: float = 1.0
    copy_rate: float = DEFAULT_COPY_RATE

    def model(self) -> CostModel:
        """The collective cost model. **Local**."""
        return CostModel.from_dict(self.cost_model)

    def install(self) -> None:
        """Make :meth:`model` the process-wide cost model that the dispatcher decides with
        (:func:`redistribute.cost.set_default_cost_model`). **Local**; every rank must
        install the same calibration."""
        set_default_cost_model(self.model())

    def kernel_terms(self, name: str, local_inputs: tuple, local_outputs: tuple
                     ) -> tuple[float, float]:
        """``(alpha_s, work / rate)`` of one call of op ``name`` on these local blocks: its
        class's fixed seconds and the seconds of its work. **Local**."""
        k = self.kernels.get(op_class(name)) or DEFAULT_KERNELS[op_class(name)]
        work = op_work(name, local_inputs, local_outputs)
        rate = float(k.get("rate", math.inf))
        return float(k["alpha_s"]), (work / rate if work and math.isfinite(rate) else 0.0)

    def kernel_seconds(self, name: str, local_inputs: tuple, local_outputs: tuple) -> float:
        """Predicted seconds of one call of op ``name`` on these local blocks (its class's
        ``alpha_s + work / rate``, without :attr:`entry_s` and :attr:`compute_scale`).
        **Local**."""
        return sum(self.kernel_terms(name, local_inputs, local_outputs))

    def to_dict(self) -> dict[str, Any]:
        kernels = {
            c: {"alpha_s": v["alpha_s"], "rate": v["rate"] if math.isfinite(v["rate"]) else None}
            for c, v in self.kernels.items()
        }
        return {"version": VERSION, "ranks": self.ranks, "mesh_shape": list(self.mesh_shape),
                "cost_model": self.cost_model, "kernels": kernels, "entry_s": self.entry_s,
                "sync_s": self.sync_s, "compute_scale": self.compute_scale,
                "p2p": self.p2p,
                "overlap_slowdown": self.overlap_slowdown, "copy_rate": self.copy_rate,
                "points": self.points}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Calibration:
        if not isinstance(data, Mapping) or data.get("version") != VERSION:
            raise ConfigError(f"calibration: not a version-{VERSION} calibration: {data!r:.200}")
        kernels = {}
        for c, v in dict(data.get("kernels", {})).items():
            if c not in CLASSES:
                raise ConfigError(f"calibration: unknown op class {c!r}; known: {CLASSES}")
            rate = v.get("rate")
            kernels[c] = {"alpha_s": float(v["alpha_s"]),
                          "rate": math.inf if rate is None else float(rate)}
        out = cls(dict(data.get("cost_model", {})), {**DEFAULT_KERNELS, **kernels},
                  int(data.get("ranks", 1)), tuple(data.get("mesh_shape", ())),
                  dict(data.get("points", {})), float(data.get("entry_s", DEFAULT_ENTRY_S)),
                  float(data.get("sync_s", DEFAULT_SYNC_S)),
                  float(data.get("compute_scale", 1.0)),
                  {k: float(v) for k, v in dict(data.get("p2p") or {}).items()},
                  float(data.get("overlap_slowdown", 1.0)),
                  float(data.get("copy_rate", DEFAULT_COPY_RATE)))
        if not out.overlap_slowdown >= 1.0 or not out.copy_rate > 0:
            raise ConfigError(
                f"calibration: overlap_slowdown must be >= 1 and copy_rate > 0, got "
                f"{out.overlap_slowdown!r} and {out.copy_rate!r}")
        out.model()  # validates the cost model
        return out

    def save(self, path: str | os.PathLike[str] | None = None) -> Path:
        """Write the calibration as JSON (default: :func:`default_path`); returns the path.
        **Local** (call it on one rank)."""
        target = Path(path) if path is not None else default_path(self.ranks)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(target.suffix + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, target)
        return target


def default_path(ranks: int) -> Path:
    """Where calibrations of ``ranks`` ranks are stored and looked up (see the module
    docstring). **Local**.

    Raises
    ------
    ConfigError
        ``$DTENSOR_CALIBRATION`` that does not name a ``.json`` file (a missing file is
        no calibration; a folder, or a name without ``.json``, is refused).
    """
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        path = Path(env).expanduser()
        if path.suffix.lower() != ".json" or path.is_dir():
            raise ConfigError(
                f"environment variable {ENV_VAR}={env!r} is not the path of a calibration "
                "file: it must name a .json file (one that `python -m launch.bench.calibrate "
                "--calibration FILE` writes), which need not exist yet")
        return path
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dtensor" / f"calibration-{ranks}.json"


def load_calibration(path: str | os.PathLike[str] | None = None,
                     ranks: int | None = None) -> Calibration | None:
    """The stored calibration at ``path`` (default: :func:`default_path` of ``ranks``), or
    None when there is none. **Local**.

    Raises
    ------
    ConfigError
        A file that is there but not a calibration.
    """
    target = Path(path) if path is not None else default_path(ranks or 1)
    if not target.exists():
        if path is not None:
            raise ConfigError(f"calibration: no file {os.fspath(target)!r}")
        return None
    try:
        data = json.loads(target.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"calibration: cannot read {os.fspath(target)!r}: {e}") from e
    return Calibration.from_dict(data)


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``(alpha, rate)`` of ``seconds = alpha + work / rate``, on relative
    residuals (small sizes, which show alpha, weigh as much as large ones). **Local**.

    Alpha is clipped at 0; a slope that does not lift the fitted time measurably across the
    work range (time not growing with work, as on tiny sizes only; the fit of flat data
    leaves a slope of rounding noise, of either sign) gives an infinite-like rate of 1e12.
    """
    x = np.array([b for b, _ in points], dtype=float)
    y = np.array([s for _, s in points], dtype=float)
    # weighted by 1/y: relative residuals, so small sizes (alpha) count as much as large ones
    w = 1.0 / np.maximum(y, 1e-12)
    slope, intercept = np.polyfit(x, y, 1, w=w) if len(set(x)) > 1 else (0.0, float(y.mean()))
    rise = slope * (x.max() - x.min())
    rate = 1.0 / slope if rise > 1e-9 * np.abs(y).max() else 1e12
    return max(float(intercept), 0.0), float(rate)


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares of a few columns: the best of the unconstrained fits on
    every subset of the columns whose coefficients are all >= 0 (the optimum is one of
    them)."""
    n = a.shape[1]
    best, out = math.inf, np.zeros(n)
    for mask in itertools.product((False, True), repeat=n):
        x = np.zeros(n)
        cols = [j for j in range(n) if mask[j]]
        if cols:
            sol = np.linalg.lstsq(a[:, cols], b, rcond=None)[0]
            if (sol < 0).any():
                continue
            x[cols] = sol
        r = float(np.sum((a @ x - b) ** 2))
        if r < best:
            best, out = r, x
    return out


def fit_to_steps(calibration: Calibration, predictions: Sequence[Any],
                 seconds: Sequence[float]) -> Calibration:
    """``calibration`` with :attr:`~Calibration.compute_scale`, :attr:`~Calibration.entry_s`
    and :attr:`~Calibration.sync_s` refitted to measured training steps. **Local**.

    ``predictions`` are :class:`~dtensor.autoshard.Prediction` s of steps (any calibration)
    and ``seconds`` their measured times. A prediction is linear in the three terms
    (``alpha_s + compute_scale * work_s + entries * entry_s + model_comm_s + collectives
    * sync_s``), so the non-negative least squares of ``seconds - alpha_s - model_comm_s``
    on ``work_s``, ``entries`` and ``collectives`` (relative residuals) gives them. A term
    that no step exercises (no collective in any of them) keeps its calibrated value; so
    does every term with fewer steps than terms to fit."""
    y = np.array(seconds, float)
    if len(y) != len(predictions):
        raise ConfigError(f"fit_to_steps: {len(predictions)} predictions and {len(y)} "
                          f"measured times")
    x = np.array([[p.work_s, p.entries, p.collectives] for p in predictions], float)
    used = [j for j in range(3) if x[:, j].any()]
    if len(y) < len(used):
        return calibration
    rest = y - np.array([p.alpha_s + p.model_comm_s for p in predictions], float)
    w = 1.0 / np.maximum(y, 1e-12)
    coef = _nnls(x[:, used] * w[:, None], rest * w)
    values = [calibration.compute_scale, calibration.entry_s, calibration.sync_s]
    for j, c in zip(used, coef):
        values[j] = float(c)
    return replace(calibration, compute_scale=values[0], entry_s=values[1], sync_s=values[2])
