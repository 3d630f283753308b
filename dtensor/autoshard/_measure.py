"""Measuring this machine for :func:`dtensor.auto_shard`: :func:`calibrate`.

This module owns the measurements behind a :class:`~dtensor.autoshard._calibrate.Calibration`:
collectives per kind and mesh dim, one op per class, and the fixed cost per traced entry of
a small training step (see :mod:`dtensor.autoshard._calibrate` for the model and the file);
and :func:`measure_steps`, the timing of the user's own step in a few layouts that
``auto_shard(..., fit_step=True)`` refits the compute scale and the fixed costs to.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from placements.types import Partial, Replicate, Shard
from redistribute import comm as _comm
from redistribute import worker as _worker
from redistribute.cost import step_bytes
from redistribute.plan import plan

from ..distributed.dtensor import DTensor, distribute_tensor
from ..local.factory import from_numpy
from ..optim import SGD
from ._calibrate import CLASSES, Calibration, fit
from ._predict import Layout, place_step, predict, trace_step

__all__ = ["calibrate", "measure_collectives", "measure_copy_rate", "measure_entry_overhead",
           "measure_kernels", "measure_overlap", "measure_steps"]

#: kind -> (source placement, target placement) on one mesh dim
_COLLECTIVE_CASES = {
    "all_gather": (Shard(0), Replicate()),
    "reduce_scatter": (Partial("sum"), Shard(0)),
    "all_reduce": (Partial("sum"), Replicate()),
    "all_to_all": (Shard(0), Shard(1)),
}



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


def measure_steps(step_fn: Callable, params: Mapping[str, Any], inputs: Mapping[str, Any],
                  mesh: Any, layouts: Sequence[Mapping[str, Layout]],
                  optimizer: Callable | None = None, repeat: int = 5) -> list[float]:
    """Seconds of one training step (``step_fn(params, inputs)``, ``backward()``, the
    optimizer's ``step()``; gradients reset before each) in each of ``layouts``: the
    slowest rank's median of ``repeat`` samples, taken in turns (one sample of each layout
    per pass, each after a barrier, so that a change of the machine's load slows them
    alike), after one warm-up step each. Arguments as :func:`predict_step
    <dtensor.autoshard.predict_step>`'s; the global values are not changed. **Collective**.
    """
    group = mesh.get_group(None)
    runs = []
    for layout in layouts:
        built, ins = place_step(params, inputs, mesh, layout)
        opt = optimizer(list(built.values())) if optimizer is not None else None

        def run(built: dict = built, ins: dict = ins, opt: Any = opt) -> None:
            for p in built.values():
                p.grad = None
            step_fn(built, ins).backward()
            if opt is not None:
                opt.step()

        run()
        runs.append(run)
    samples: list[list[float]] = [[] for _ in runs]
    for _ in range(repeat):
        for run, out in zip(runs, samples):
            group.barrier()
            start = time.perf_counter()
            run()
            out.append(time.perf_counter() - start)
    value = np.array([statistics.median(v) for v in samples])
    group.allreduce(value, op="max")
    return [float(v) for v in value]


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


def measure_p2p(mesh: Any, sizes: list[int], repeat: int = 7) -> list[tuple[int, float]]:
    """``[(bytes, seconds), ...]`` of one point-to-point ring step (the constants of
    :attr:`Calibration.p2p`: a pipeline's activations, ring attention's blocks): each rank
    sends a float32 ``N x N`` block to the next rank of the mesh and receives one from the
    previous (``Comm.sendrecv``), for N in ``sizes``; the slowest rank's median. Empty on
    one rank. **Collective**."""
    comm = mesh.get_group(None)
    if comm.size < 2:
        return []
    nxt, prev = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    out = []
    for n in sizes:
        send = np.ones((n, n), np.float32)
        recv = np.empty_like(send)
        seconds = _seconds(mesh, lambda s=send, r=recv: comm.sendrecv(s, nxt, r, prev, 7),
                           repeat, 3)
        out.append((int(send.nbytes), seconds))
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


def _small_step_seconds(mesh: Any, calibration: Calibration, x_layout: list,
                        repeat: int) -> tuple[float, float, int, int]:
    """A two-layer MLP training step with SGD on 16 x 32 tensors, the batch in
    ``x_layout``, weights replicated: its measured seconds, its predicted seconds without
    the fixed costs (:attr:`Calibration.entry_s`, :attr:`Calibration.sync_s`), its op
    entries and its collectives. **Collective**."""
    rng = np.random.default_rng(0)
    rep = [Replicate()] * mesh.ndim
    x = distribute_tensor(rng.standard_normal((16, 32)).astype(np.float32), mesh, x_layout,
                          src_data_rank=None)
    params = {n: distribute_tensor(rng.standard_normal(shape).astype(np.float32), mesh, rep,
                                   src_data_rank=None).requires_grad_()
              for n, shape in (("w1", (32, 32)), ("w2", (32, 8)))}
    inputs = {"x": x}

    def loss_of(p: dict, b: dict) -> Any:
        return ((b["x"] @ p["w1"]).relu() @ p["w2"]).tanh().square().mean()

    opt = SGD(list(params.values()), lr=1e-3, momentum=0.9)

    def step() -> None:
        opt.zero_grad()
        loss_of(params, inputs).backward()
        opt.step()

    seconds = _seconds(mesh, step, repeat, 5)
    trace = trace_step(loss_of, params, inputs, lambda ps: SGD(ps, lr=1e-3, momentum=0.9))
    flat = Calibration(calibration.cost_model, calibration.kernels, entry_s=0.0, sync_s=0.0)
    p = predict(trace, flat, params, inputs)
    entries = sum(o.op != "redistribute" for o in trace.explanation.ops)
    return seconds, p.time_s, entries, p.collectives


def measure_entry_overhead(mesh: Any, calibration: Calibration, repeat: int = 7
                           ) -> tuple[float, float]:
    """``(entry_s, sync_s)``: the fixed costs per op entry and per collective of a training
    step that the kernels and the cost model do not explain. **Collective**.

    ``entry_s``: (measured - predicted) / entries of a small replicated MLP step (no
    communication); ``sync_s``: the same step data-parallel (the batch sharded over every
    mesh dim; its gradients are all-reduced), its unexplained time beyond the entries'
    per collective (ranks that reach a collective at different times wait for each other).
    Both at least 0."""
    rep = [Replicate()] * mesh.ndim
    seconds, predicted, entries, _ = _small_step_seconds(mesh, calibration, rep, repeat)
    entry_s = max(seconds - predicted, 0.0) / max(entries, 1)
    if mesh.size() == 1:
        return entry_s, 0.0
    seconds, predicted, entries, colls = _small_step_seconds(
        mesh, calibration, [Shard(0)] * mesh.ndim, repeat)
    sync_s = max(seconds - predicted - entries * entry_s, 0.0) / max(colls, 1)
    return entry_s, sync_s


def measure_copy_rate(mesh: Any, nbytes: int = 32 << 20, repeat: int = 7) -> float:
    """Bytes per second (read + written) of ``np.copyto`` between two ``nbytes`` buffers
    (out of the caches at the default 32 MiB), the slowest rank's median. **Collective**
    (timing barriers)."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    seconds = _seconds(mesh, lambda: np.copyto(dst, src), repeat, 3)
    return 2.0 * src.nbytes / max(seconds, 1e-12)


def measure_overlap(mesh: Any, n: int = 384, gather_bytes: int = 8 << 20, repeat: int = 7
                    ) -> tuple[float, float, float]:
    """``(matmul seconds alone, matmul seconds beside all-gathers, one all-gather's
    seconds)``: ``matmuls`` products of ``n x n`` float32 local tensors (the dispatcher's
    ``@``), timed alone and while the asynchronous worker thread runs all-gathers of
    ``gather_bytes`` on mesh dim 0 (as ``fully_shard``'s prefetch does), in turns, the
    slowest rank's medians. The all-gathers outlast the matmuls (their count is chosen
    from single timings and agreed on by every rank). **Collective**."""
    rng = np.random.default_rng(0)
    a = from_numpy(rng.standard_normal((n, n)).astype(np.float32))
    group = mesh.get_group(0)
    base = mesh.get_group(None)
    elems = max(gather_bytes // 4 // group.size, 1)
    send = np.ones(elems, np.float32)
    recv = np.empty(elems * group.size, np.float32)
    counts = [elems] * group.size

    def gathers(k: int) -> None:
        twin = group.twin()
        for _ in range(k):
            twin.allgatherv(send, recv, counts, what="calibrate")

    number = 5
    matmul_s = _seconds(mesh, lambda: a @ a, repeat, number) * number
    gather_s = _seconds(mesh, lambda: gathers(1), repeat, 1)
    k = np.array([int(2 * matmul_s / max(gather_s, 1e-9)) + 2])
    base.allreduce(k, op="max")
    alone, beside = [], []
    for _ in range(repeat):
        base.barrier()
        t0 = time.perf_counter()
        for _ in range(number):
            a @ a
        alone.append(time.perf_counter() - t0)
        base.barrier()
        handle = _worker.submit(lambda: gathers(int(k[0])))
        t0 = time.perf_counter()
        for _ in range(number):
            a @ a
        beside.append(time.perf_counter() - t0)
        handle.wait()
    value = np.array([statistics.median(alone), statistics.median(beside), gather_s])
    base.allreduce(value, op="max")
    return float(value[0]), float(value[1]), float(value[2])


def calibrate(mesh: Any, path: str | os.PathLike[str] | None = None, *,
              sizes: tuple[int, ...] = (32, 128, 384), repeat: int = 7,
              save: bool = True, comm_sizes: tuple[int, ...] | None = None) -> Calibration:
    """Measure this machine on ``mesh`` and store the result. **Collective**.

    Times every collective kind of the cost model on each mesh dim (``DTensor.redistribute``
    of float32 ``N x N`` tensors for N in ``sizes``; the slowest rank's median) and fits
    ``alpha_s`` and ``beta_bytes_per_s`` per kind and mesh dim, and a point-to-point ring step
    of the same blocks (:attr:`Calibration.p2p`, :func:`measure_p2p`); times one op per class
    of :data:`CLASSES` on replicated DTensors (dispatch included) and fits ``alpha_s`` and
    ``rate`` per class; times a small training step and takes what its kernels do not
    explain, per traced entry and per collective (:func:`measure_entry_overhead`); times a
    large memory copy (:func:`measure_copy_rate`) and, on more than one rank, a matmul
    alone and beside the worker thread's all-gathers (:func:`measure_overlap`:
    ``overlap_slowdown``).

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
    comm_sizes : tuple of int, optional
        The N of the collectives' tensors, when they should reach further than the kernels'
        ``sizes`` (default: ``sizes``). A collective's bandwidth drops once its buffers
        leave the caches (on a 2-core machine, from about 4 MiB to about half of that
        beyond 7 MiB): a model whose collectives move tens of MiB needs points there, and
        the kernels need no N x N matmul of that size.

    Returns
    -------
    Calibration
        Use it with ``auto_shard(..., calibration=...)``; ``.install()`` makes its cost
        model the dispatcher's.
    """
    sizes_l = [int(s) for s in sizes]
    per_dim: dict[str, dict[str, dict[str, float]]] = {}
    points: dict[str, Any] = {"collectives": {}, "kernels": {}}
    comm_l = sizes_l if comm_sizes is None else [int(s) for s in comm_sizes]
    for m, kinds in measure_collectives(mesh, comm_l, repeat).items():
        points["collectives"][str(m)] = kinds
        per_dim[str(m)] = {}
        for kind, pts in kinds.items():
            alpha, beta = fit(pts)
            per_dim[str(m)][kind] = {"alpha_s": alpha, "beta_bytes_per_s": beta}
    points["p2p"] = measure_p2p(mesh, comm_l, repeat)
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
    entry_s, sync_s = measure_entry_overhead(mesh, result, repeat)
    result = Calibration(cost_model, kernels, mesh.size(), tuple(mesh.shape), points, entry_s,
                         sync_s, p2p=dict(zip(("alpha_s", "beta_bytes_per_s"),
                                              fit(points["p2p"]))) if points["p2p"] else {})
    copy_rate = measure_copy_rate(mesh, repeat=repeat)
    points["copy_rate"] = copy_rate
    if mesh.size() > 1 and _comm.thread_multiple():
        n = max(sizes_l)
        alone, beside, gather = measure_overlap(mesh, n, repeat=repeat)
        points["overlap"] = {"matmul_n": n, "alone_s": alone, "beside_s": beside,
                             "gather_bytes": 8 << 20, "gather_s": gather}
        slowdown = max(beside / alone, 1.0) if alone > 0 else 1.0
    else:  # one rank, or no worker thread (its collectives then run in line)
        slowdown = 1.0
    result = replace(result, overlap_slowdown=slowdown, copy_rate=copy_rate)
    result.model()  # validates what is stored
    if save and mesh.get_rank() == 0:
        result.save(path)
    return result
