"""Calibration of :func:`dtensor.auto_shard`'s predictions: collectives and kernels measured
on this machine.

This module owns :class:`Calibration` (the redistribute cost model's constants per mesh dim
and the kernel throughput per op class), :func:`calibrate` (measures both on a mesh),
:func:`load_calibration` / :meth:`Calibration.save` (the JSON file, reused between runs),
:func:`fit` (the least-squares ``seconds = alpha + work / rate`` used for both) and the
pricing of one traced op's local compute (:func:`op_class`, :meth:`Calibration.kernel_seconds`).

Op classes and their work measure:

=========  ===============================================  ============================
class      ops (the op table's sample families)              work
=========  ===============================================  ============================
matmul     product (matmul, mm, bmm, linear, einsum, ...)     flops: ``2 * out * K``
nn         nn, reduce, scan (softmax, layer_norm, ...)        bytes read + written
pointwise  every other op that computes                       bytes read + written
view       view (reshape, transpose, unsqueeze, ...)          none (a fixed cost)
=========  ===============================================  ============================

A kernel's time is ``alpha_s + work / rate`` of its class; ``alpha_s`` includes the
dispatch of one op on DTensors (what dominates small ops). The JSON file::

    {"version": 1, "ranks": 2, "mesh_shape": [2],
     "cost_model": {...the redistribute.cost.CostModel format...},
     "kernels": {"matmul": {"alpha_s": 2e-05, "rate": 2e10}, ...},
     "points": {...the measured points...}}

The default file is ``$DTENSOR_CALIBRATION`` when set, else
``$XDG_CACHE_HOME/dtensor/calibration-<ranks>.json`` (``~/.cache`` without XDG_CACHE_HOME).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from placements.errors import ConfigError
from placements.types import Partial, Replicate, Shard
from redistribute.cost import CostModel, set_default_cost_model, step_bytes
from redistribute.plan import plan

from ..distributed.dtensor import DTensor, distribute_tensor
from ..local.factory import from_numpy
from ..ops.table import OPS

__all__ = [
    "CLASSES",
    "Calibration",
    "calibrate",
    "default_path",
    "fit",
    "load_calibration",
    "op_class",
]

ENV_VAR = "DTENSOR_CALIBRATION"
VERSION = 1

#: Op classes priced by their own throughput.
CLASSES = ("matmul", "nn", "pointwise", "view")

_CLASS_OF_FAMILY = {"product": "matmul", "nn": "nn", "reduce": "nn", "scan": "nn", "view": "view"}

#: Kernel constants used when no calibration is given (rough figures of one CPU core).
DEFAULT_KERNELS: dict[str, dict[str, float]] = {
    "matmul": {"alpha_s": 2e-5, "rate": 2e10},
    "nn": {"alpha_s": 3e-5, "rate": 2e9},
    "pointwise": {"alpha_s": 1e-5, "rate": 4e9},
    "view": {"alpha_s": 5e-6, "rate": math.inf},
}

#: kind -> (source placement, target placement) on one mesh dim
_COLLECTIVE_CASES = {
    "all_gather": (Shard(0), Replicate()),
    "reduce_scatter": (Partial("sum"), Shard(0)),
    "all_reduce": (Partial("sum"), Replicate()),
    "all_to_all": (Shard(0), Shard(1)),
}


def op_class(name: str) -> str:
    """The class (:data:`CLASSES`) whose throughput prices op ``name``. **Local**.

    ``redistribute`` (a traced move) and unknown names are ``view`` (no local compute
    beyond the move, which the cost model prices)."""
    info = OPS.get(name)
    if info is None:
        return "view"
    return _CLASS_OF_FAMILY.get(info.samples, "pointwise")


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
    """

    cost_model: dict[str, Any] = field(default_factory=dict)
    kernels: dict[str, dict[str, float]] = field(default_factory=lambda: dict(DEFAULT_KERNELS))
    ranks: int = 1
    mesh_shape: tuple[int, ...] = ()
    points: dict[str, Any] = field(default_factory=dict)

    def model(self) -> CostModel:
        """The collective cost model. **Local**."""
        return CostModel.from_dict(self.cost_model)

    def install(self) -> None:
        """Make :meth:`model` the process-wide cost model that the dispatcher decides with
        (:func:`redistribute.cost.set_default_cost_model`). **Local**; every rank must
        install the same calibration."""
        set_default_cost_model(self.model())

    def kernel_seconds(self, name: str, local_inputs: tuple, local_outputs: tuple) -> float:
        """Predicted seconds of one call of op ``name`` on these local blocks. **Local**."""
        k = self.kernels.get(op_class(name)) or DEFAULT_KERNELS[op_class(name)]
        work = op_work(name, local_inputs, local_outputs)
        rate = float(k.get("rate", math.inf))
        return float(k["alpha_s"]) + (work / rate if work and math.isfinite(rate) else 0.0)

    def to_dict(self) -> dict[str, Any]:
        kernels = {
            c: {"alpha_s": v["alpha_s"], "rate": v["rate"] if math.isfinite(v["rate"]) else None}
            for c, v in self.kernels.items()
        }
        return {"version": VERSION, "ranks": self.ranks, "mesh_shape": list(self.mesh_shape),
                "cost_model": self.cost_model, "kernels": kernels, "points": self.points}

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
                  dict(data.get("points", {})))
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
    docstring). **Local**."""
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        return Path(env)
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


def _seconds(mesh: Any, call: Callable[[], object], repeat: int, number: int) -> float:
    """Median seconds per call on the slowest rank (each sample starts after a barrier).
    **Collective**."""
    base = mesh.get_group(None)
    call()
    samples = []
    for _ in range(repeat):
        base.barrier()
        start = time.perf_counter()
        for _ in range(number):
            call()
        samples.append((time.perf_counter() - start) / number)
    value = np.array([statistics.median(samples)])
    base.allreduce(value, op="max")
    return float(value[0])


def measure_collectives(mesh: Any, sizes: list[int], repeat: int = 7
                        ) -> dict[int, dict[str, list[tuple[int, float]]]]:
    """``{mesh dim: {kind: [(bytes per rank, seconds), ...]}}``: ``DTensor.redistribute``
    of float32 NxN tensors for each collective kind of the cost model, on each mesh dim of
    size > 1 (Replicate on the others). **Collective**."""
    out: dict[int, dict[str, list]] = {}
    for m in range(mesh.ndim):
        if mesh.shape[m] == 1:
            continue
        for kind, (src_p, dst_p) in _COLLECTIVE_CASES.items():
            src = [Replicate()] * mesh.ndim
            dst = list(src)
            src[m], dst[m] = src_p, dst_p
            for n in sizes:
                a = np.ones((n, n), np.float32)
                if src_p.is_partial():
                    x = DTensor.from_local(from_numpy(a), mesh, src)
                else:
                    x = distribute_tensor(a, mesh, src, src_data_rank=None)
                nbytes = sum(step_bytes(s, x._spec) for s in plan(x._spec, tuple(dst))
                             if s.communicates)
                seconds = _seconds(mesh, lambda x=x, dst=dst: x.redistribute(mesh, dst),
                                   repeat, 3)
                out.setdefault(m, {}).setdefault(kind, []).append((nbytes, seconds))
    return out


def _kernel_cases(sizes: list[int]) -> dict[str, list[tuple[float, Callable, int]]]:
    """Per op class: (work, op on DTensors, N of its N x N float32 operands) samples."""
    out: dict[str, list] = {c: [] for c in CLASSES}
    for n in sizes:
        nbytes = 4 * n * n
        out["matmul"].append((2.0 * n ** 3, lambda a, b: a @ b, n))
        out["pointwise"].append((3.0 * nbytes, lambda a, b: a + b, n))
        out["nn"].append((2.0 * nbytes, lambda a, b: a.softmax(-1), n))
        out["view"].append((0.0, lambda a, b: a.transpose(0, 1), n))
    return out


def measure_kernels(mesh: Any, sizes: list[int], repeat: int = 7
                    ) -> dict[str, list[tuple[float, float]]]:
    """``{class: [(work, seconds), ...]}``: one op per class on replicated DTensors that
    require grad, as in a training step's forward (the dispatch and autograd's recording
    included, no communication). **Collective** (timing barriers)."""
    rep = [Replicate()] * mesh.ndim
    out: dict[str, list] = {}
    for cls, cases in _kernel_cases(sizes).items():
        for work, fn, n in cases:
            a = distribute_tensor(np.ones((n, n), np.float32), mesh, rep, src_data_rank=None)
            a.requires_grad_()
            seconds = _seconds(mesh, lambda fn=fn, a=a: fn(a, a), repeat, 5)
            out.setdefault(cls, []).append((work, seconds))
    return out


def calibrate(mesh: Any, path: str | os.PathLike[str] | None = None, *,
              sizes: tuple[int, ...] = (32, 128, 384), repeat: int = 7,
              save: bool = True) -> Calibration:
    """Measure this machine on ``mesh`` and store the result. **Collective**.

    Times every collective kind of the cost model on each mesh dim (``DTensor.redistribute``
    of float32 ``N x N`` tensors for N in ``sizes``; the slowest rank's median) and fits
    ``alpha_s`` and ``beta_bytes_per_s`` per kind and mesh dim; times one op per class of
    :data:`CLASSES` on replicated DTensors (dispatch included) and fits ``alpha_s`` and
    ``rate`` per class.

    Parameters
    ----------
    mesh : DeviceMesh
    path : path, optional
        Where to write the JSON (rank 0 writes); default :func:`default_path`.
    sizes : tuple of int
        The N of the measured tensors.
    repeat : int
        Timing samples per point.
    save : bool
        Write the file (rank 0). The result is returned either way.

    Returns
    -------
    Calibration
        Use it with ``auto_shard(..., calibration=...)``; ``.install()`` makes its cost
        model the dispatcher's.
    """
    sizes_l = [int(s) for s in sizes]
    per_dim: dict[str, dict[str, dict[str, float]]] = {}
    points: dict[str, Any] = {"collectives": {}, "kernels": {}}
    for m, kinds in measure_collectives(mesh, sizes_l, repeat).items():
        points["collectives"][str(m)] = kinds
        per_dim[str(m)] = {}
        for kind, pts in kinds.items():
            alpha, beta = fit(pts)
            per_dim[str(m)][kind] = {"alpha_s": alpha, "beta_bytes_per_s": beta}
    cost_model: dict[str, Any] = {}
    if per_dim:
        fits = [v for entries in per_dim.values() for v in entries.values()]
        cost_model = {
            "alpha_s": statistics.median(v["alpha_s"] for v in fits),
            "beta_bytes_per_s": statistics.median(v["beta_bytes_per_s"] for v in fits),
            "per_kind": next(iter(per_dim.values())),  # the first mesh dim's, for other meshes
            "per_mesh_dim": per_dim,
        }
    kernels = {}
    for cls, pts in measure_kernels(mesh, sizes_l, repeat).items():
        points["kernels"][cls] = pts
        alpha, rate = fit(pts) if cls != "view" else (
            statistics.median(s for _, s in pts), math.inf)
        kernels[cls] = {"alpha_s": alpha, "rate": rate}
    result = Calibration(cost_model, kernels, mesh.size(), tuple(mesh.shape), points)
    result.model()  # validates what is stored
    if save and mesh.get_rank() == 0:
        result.save(path)
    return result
