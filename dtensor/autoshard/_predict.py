"""Candidates, one traced step and its prediction: the pieces :func:`dtensor.auto_shard`
evaluates a placement assignment with.

This module owns :func:`candidate_placements` (the legal ``Replicate`` / ``Shard(d)``
choices of a tensor on a mesh), :func:`build_tensors` (an assignment's DTensors from the
global arrays), :func:`trace_step` (one training step run under
:func:`dtensor.debug.explain`) and :func:`predict` (a trace priced as a
:class:`Prediction`). Each is small and separate so that a metadata-only trace can replace
:func:`build_tensors` and :func:`trace_step` without touching the pricing or the search.

Time model: the sum over the traced entries (forward, backward and optimizer ops,
explicit redistributes, gradient moves) of the entry's local compute (for an op:
``Calibration.entry_s`` plus :meth:`Calibration.kernel_seconds` of its op class on the
local blocks its kernel sees, the largest over ranks, its work's seconds times
``Calibration.compute_scale``) and of its collectives' cost-model
seconds plus ``Calibration.sync_s`` each (the dispatcher's own
model, :func:`redistribute.cost.default_cost_model`, so the prices are those of the plans
it runs).

Memory model (bytes on the rank with the largest blocks):

- persistent: every parameter's local block twice (the parameter and its gradient, laid
  out like it), the optimizer's state (its DTensors' local blocks after one step), the
  inputs' local blocks;
- activations: the outputs of every forward entry that computes (view ops share their
  input's memory), all of them kept until backward (an upper bound of what autograd
  saves), plus the largest output of one backward entry (backward's transient peak).

``peak = persistent + activations``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from placements.layout import max_local_shape
from placements.types import Placement, Replicate, Shard

from ..debug import Explanation, explain
from ..distributed.abstract import AbstractDTensor, AbstractMesh, abstract_like
from ..distributed.dtensor import DTensor, distribute_tensor
from ._calibrate import Calibration, op_class

__all__ = [
    "Prediction",
    "as_array",
    "build_tensors",
    "candidate_placements",
    "place_step",
    "predict",
    "predict_step",
    "trace_step",
]

Layout = tuple[Placement, ...]


def candidate_placements(shape: Sequence[int], mesh_shape: Sequence[int],
                         dims: Sequence[int] | None = None) -> list[Layout]:
    """Every assignment of ``Replicate`` or ``Shard(d)`` (``d`` in ``dims``, default every
    tensor dim) to each mesh dim that leaves no rank an empty block: a tensor dim sharded
    over mesh dims of total size ``k`` needs at least ``k`` elements. Replicate everywhere
    comes first. **Local**."""
    dims = range(len(shape)) if dims is None else dims
    one = [Replicate(), *(Shard(d) for d in dims if 0 <= d < len(shape))]
    out: list[Layout] = [()]
    for _ in mesh_shape:
        out = [(*prefix, p) for prefix in out for p in one]
        out = [c for c in out if _legal(c, shape, mesh_shape)]
    return out


def _legal(layout: Layout, shape: Sequence[int], mesh_shape: Sequence[int]) -> bool:
    parts: dict[int, int] = {}
    for m, p in enumerate(layout):
        if isinstance(p, Shard):
            parts[p.dim] = parts.get(p.dim, 1) * mesh_shape[m]
    return all(shape[d] >= k for d, k in parts.items())


def as_array(v: Any) -> np.ndarray:
    """A global value given as a numpy array or a local tensor, as a numpy array; a
    metadata-only DTensor as a read-only array of its global shape and dtype that holds no
    data (one element broadcast)."""
    if isinstance(v, AbstractDTensor):
        return np.broadcast_to(np.zeros((), v.dtype), tuple(v.shape))
    return v.numpy() if hasattr(v, "numpy") and not isinstance(v, np.ndarray) else np.asarray(v)


def build_tensors(arrays: Mapping[str, np.ndarray], mesh: Any, layouts: Mapping[str, Layout],
                  requires_grad: bool) -> dict[str, Any]:
    """The DTensors of one assignment: each global array distributed with its layout (each
    rank takes its own block of a copy, so that a traced optimizer step leaves the arrays
    as they are; nothing is sent), leaves that require grad when asked. On an
    :class:`~dtensor.AbstractMesh` they are metadata-only DTensors of the arrays' shapes and
    dtypes (no data). **Local**."""
    out = {}
    for name, a in arrays.items():
        if isinstance(mesh, AbstractMesh):
            out[name] = abstract_like(a, mesh, layouts[name], requires_grad=requires_grad)
            continue
        t = distribute_tensor(np.array(a), mesh, list(layouts[name]), src_data_rank=None)
        out[name] = t.requires_grad_() if requires_grad else t
    return out


@dataclass
class Trace:
    """One traced training step: the explanation and the optimizer's state bytes."""

    explanation: Explanation
    optimizer_state_bytes: int = 0


def _local_bytes(t: Any) -> int:
    if isinstance(t, DTensor):
        spec = t._spec
        return math.prod(max_local_shape(spec.shape, spec.mesh_shape, spec.placements)) * (
            spec.dtype.itemsize)
    return int(getattr(t, "nbytes", 0) or 0)


def trace_step(step_fn: Callable, params: Mapping[str, Any], inputs: Mapping[str, Any],
               optimizer: Callable | None = None) -> Trace:
    """Run one training step under :func:`dtensor.debug.explain`: ``loss = step_fn(params,
    inputs)``, ``loss.backward()`` and, with ``optimizer`` (a callable that makes an
    optimizer of a list of parameters), one ``step()`` of it. **Collective**."""
    state: dict[str, Any] = {}

    def _one_step() -> Any:
        loss = step_fn(params, inputs)
        loss.backward()
        if optimizer is not None:
            opt = optimizer(list(params.values()))
            opt.step()
            state["opt"] = opt
        return loss

    expl = explain(_one_step, top=0)
    opt = state.get("opt")
    nbytes = 0
    if opt is not None:
        for per_param in getattr(opt, "state", {}).values():
            nbytes += sum(_local_bytes(v) for v in per_param.values() if hasattr(v, "shape"))
    return Trace(expl, nbytes)


@dataclass(frozen=True)
class Prediction:
    """The predicted cost of one training step (see the module docstring).

    ``phases`` splits ``time_s`` into forward, backward and optimizer (the entries after
    the last backward one). ``entries`` (op entries, explicit redistributes not counted),
    ``alpha_s`` and ``work_s`` (their kernels' fixed and work seconds, the latter without
    ``Calibration.compute_scale``) and ``model_comm_s`` (the collectives' cost-model
    seconds, without ``Calibration.sync_s``) are the terms the prediction is linear in:
    ``time_s = alpha_s + compute_scale * work_s + entries * entry_s + model_comm_s +
    collectives * sync_s``. ``attention_s`` (the attention kernels' seconds, forward and
    backward), ``attention_calls`` and ``attention_kv_bytes`` (the local keys and values of
    the forward's calls) are what context parallelism changes (see
    :class:`dtensor.pipelining.PipelineOptions`)."""

    time_s: float
    compute_s: float
    comm_s: float
    peak_bytes: int
    persistent_bytes: int
    activation_bytes: int
    collectives: int
    phases: dict[str, float] = field(default_factory=dict)
    entries: int = 0
    alpha_s: float = 0.0
    work_s: float = 0.0
    model_comm_s: float = 0.0
    attention_s: float = 0.0
    attention_calls: int = 0
    attention_kv_bytes: int = 0

    def time_with(self, calibration: Calibration) -> float:
        """This step's seconds priced with ``calibration``'s compute scale and fixed costs
        (the kernels and the cost model as they were). **Local**."""
        return (self.alpha_s + calibration.compute_scale * self.work_s
                + calibration.entry_s * self.entries + self.model_comm_s
                + calibration.sync_s * self.collectives)


def _block_bytes(block: Any) -> int:
    shape, dtype = block
    return math.prod(shape) * np.dtype(dtype).itemsize


def predict(trace: Trace, calibration: Calibration, params: Mapping[str, Any],
            inputs: Mapping[str, Any]) -> Prediction:
    """Price a traced step. **Local**."""
    ops = trace.explanation.ops
    backward = [i for i, o in enumerate(ops) if o.phase == "backward"]
    first, last = (backward[0], backward[-1]) if backward else (len(ops), len(ops))
    compute = comm = 0.0
    phases = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
    saved = transient = collectives = entries = 0
    alphas = works = model_comm = attention = 0.0
    calls = kv = 0
    for i, o in enumerate(ops):
        kernel = 0.0
        if o.op != "redistribute":
            entries += 1
            alpha, work = calibration.kernel_terms(o.op, o.local_inputs, o.local_outputs)
            alphas += alpha
            works += work
            kernel = alpha + calibration.compute_scale * work + calibration.entry_s
            if o.op.startswith("scaled_dot_product_attention"):
                attention += kernel
                if o.op == "scaled_dot_product_attention":
                    calls += 1
                    kv += sum(_block_bytes(b) for b in o.local_inputs[1:3])
        moved = [c for c in o.collectives if c.communicates]
        seconds = sum(c.seconds for c in moved)
        model_comm += seconds
        seconds += calibration.sync_s * len(moved)
        collectives += len(moved)
        compute += kernel
        comm += seconds
        out = sum(_block_bytes(b) for b in o.local_outputs)
        if o.phase == "backward":
            phases["backward"] += kernel + seconds
            transient = max(transient, out)
        elif i > last:
            phases["optimizer"] += kernel + seconds
        else:
            phases["forward"] += kernel + seconds
            if i < first and (o.op == "redistribute" or op_class(o.op) != "view"):
                saved += out
    persistent = 2 * sum(_local_bytes(p) for p in params.values())
    persistent += trace.optimizer_state_bytes + sum(_local_bytes(v) for v in inputs.values())
    activations = saved + transient
    return Prediction(compute + comm, compute, comm, persistent + activations, persistent,
                      activations, collectives, phases, entries, alphas, works, model_comm,
                      attention, calls, kv)


def place_step(params: Mapping[str, Any], inputs: Mapping[str, Any], mesh: Any,
               layouts: Mapping[str, Layout]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The parameters (leaves that require grad) and inputs of one step in ``layouts``, as
    :func:`predict_step` takes them. **Local**."""
    arrays = {n: as_array(v) for n, v in params.items()}
    placed = {n: as_array(v) for n, v in inputs.items() if n in layouts}
    built = build_tensors(arrays, mesh, layouts, True)
    return built, {**inputs, **build_tensors(placed, mesh, layouts, False)}


def predict_step(step_fn: Callable, params: Mapping[str, Any], inputs: Mapping[str, Any],
                 mesh: Any, layouts: Mapping[str, Layout], *, optimizer: Callable | None = None,
                 calibration: Calibration | None = None) -> Prediction:
    """The prediction of one training step with the given placements. **Collective** (it
    runs the step once, traced).

    Parameters
    ----------
    step_fn, optimizer
        As for :func:`dtensor.auto_shard`.
    params : dict of str to array
        The parameters' global values (numpy arrays or local tensors, the same on every
        rank); each is placed by ``layouts`` and requires grad.
    inputs : dict of str to object
        The step's inputs: arrays named in ``layouts`` are placed by it; other values
        (DTensors included) are passed as they are.
    mesh : DeviceMesh
    layouts : dict of str to tuple of Placement
        Placements of every parameter and of the inputs to place.
    calibration : Calibration, optional
        Default: built-in kernel constants.
    """
    built, ins = place_step(params, inputs, mesh, layouts)
    trace = trace_step(step_fn, built, ins, optimizer)
    return predict(trace, calibration or Calibration(), built, ins)
