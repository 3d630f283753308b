"""Every record of the op table against torch on real meshes: forward and backward.

For each op, a deterministic subset of its sample calls (:func:`dtensor.validate.
sample_calls`; the unit suite ``tests/unit/ops/test_torch_differential.py`` runs them all)
runs with every tensor argument laid out under random placements drawn from the ``rng``
fixture (the same on every rank): Replicate, Shard of any dim (uneven and empty shards on 3
and 4 ranks) and, for float arguments, Partial sum with random per-rank addends
(:func:`dtensor.testing.distribute_random`). The outputs' ``full_tensor()`` must equal torch
on the global data; then the float arguments, as float64 DTensor leaves, get gradients from
``dt.autograd.grad`` of ``sum(out * upstream)``, compared after ``full_tensor()`` with
``torch.autograd.grad``. In-place ops and the ops with documented differences from torch
(``helpers.torch_ops``) are left to the unit suite.
"""

from __future__ import annotations

import functools
import zlib

import numpy as np
import pytest
from helpers import torch_ops as T
from helpers.mpi import meshes_dp_tp

import dtensor as dt
from dtensor.ops import NOT_DIFFERENTIABLE, OPS
from dtensor.testing import distribute_random
from dtensor.validate import SampleCall, sample_calls

pytestmark = pytest.mark.torch

#: sample calls checked per op (spread over its list)
_PER_OP = 2
_SKIP = {n for n in OPS if OPS[n].inplace or n.rstrip("_") in T.DIFFERENCES
         or n.rstrip("_") in T.BOOL_AS_UINT8 or n in ("getitem", "scatter", "pow", "dropout",
                                                     "scaled_dot_product_attention")}
NAMES = sorted(set(OPS) - _SKIP)


@functools.cache
def _calls(name: str) -> list[SampleCall]:
    calls = sample_calls(OPS[name], seed=zlib.crc32(name.encode()))
    step = max(1, len(calls) // _PER_OP)
    return calls[::step][:_PER_OP]


@pytest.fixture(scope="module")
def meshes() -> list[dt.DeviceMesh]:
    return meshes_dp_tp()


def _placements(v: np.ndarray, mesh, rng, partial: bool) -> list:
    out = []
    for _ in mesh.shape:
        kinds = [dt.Replicate()] + [dt.Shard(d) for d in range(v.ndim)]
        if partial and v.dtype.kind == "f":
            kinds.append(dt.Partial("sum"))
        out.append(kinds[int(rng.integers(len(kinds)))])
    return out


def _layout(call: SampleCall, mesh, rng, f64: bool, grad: bool):
    values = [list(v) if isinstance(v, list) else v for v in call.values]
    leaves = []
    for pi, ei in call.slots:
        v = call.arg((pi, ei))
        if not isinstance(v, np.ndarray):
            continue
        a = v.astype(np.float64) if f64 and v.dtype.kind == "f" else v
        x = distribute_random(a, mesh, _placements(a, mesh, rng, True),
                              seed=int(rng.integers(2**31)))
        if grad and a.dtype.kind == "f" and (call.info.name, call.info.params[pi]) \
                not in T.NO_GRAD:
            x.requires_grad_()
            leaves.append(((pi, ei), x))
        if ei < 0:
            values[pi] = x
        else:
            values[pi][ei] = x
    return values, leaves


def _full(o) -> np.ndarray:
    return o.full_tensor().detach().numpy() if isinstance(o, dt.DTensor) else np.asarray(o)


def _close(g: np.ndarray, w: np.ndarray, tol: float, what: str) -> None:
    assert g.shape == w.shape, f"{what}: shape {g.shape}, torch {w.shape}"
    assert g.dtype.name == w.dtype.name, f"{what}: dtype {g.dtype}, torch {w.dtype}"
    if g.dtype.kind == "f" or g.dtype.name == "bfloat16":
        g, w = g.astype(np.float64), w.astype(np.float64)
        ok = np.isclose(g, w, rtol=tol, atol=tol, equal_nan=True)
        assert ok.all(), f"{what}: differs at {np.argwhere(~ok)[:3].tolist()}"
    else:
        assert np.array_equal(g, w), f"{what}: differs"


def _np(t) -> np.ndarray:
    torch = T.torch_module()
    t = t.detach()
    return t.float().numpy().astype(dt.bfloat16) if t.dtype == torch.bfloat16 else t.numpy()


def _outs(out) -> list:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _check(call: SampleCall, mesh, rng) -> None:
    torch = T.torch_module()
    info = call.info
    what = f"{info.name} {call.label} on mesh {tuple(mesh.shape)}"
    values, _ = _layout(call, mesh, rng, f64=False, grad=False)
    dt.set_rng_state(call.rng_state)
    with np.errstate(all="ignore"):
        got = _outs(T.call_dt(info, values))
    want = [_np(w) for w in _outs(T.call_torch(info, call.values))]
    for k, (g, w) in enumerate(zip(got, want)):
        tol = {"bfloat16": 3e-2, "float16": 3e-3, "float32": 1e-3}.get(w.dtype.name, 1e-6)
        _close(_full(g), w, tol, f"{what}: output {k}")
    if info.backward is NOT_DIFFERENTIABLE:
        return
    values, leaves = _layout(call, mesh, rng, f64=True, grad=True)
    if not leaves:
        return
    tvalues = [list(v) if isinstance(v, list) else v for v in call.values]
    tleaves = []
    for (pi, ei), _ in leaves:
        t = torch.from_numpy(call.arg((pi, ei)).astype(np.float64)).requires_grad_()
        tleaves.append(t)
        if ei < 0:
            tvalues[pi] = t
        else:
            tvalues[pi][ei] = t
    dt.set_rng_state(call.rng_state)
    with np.errstate(all="ignore"):
        got = _outs(T.call_dt(info, values))
    want = _outs(T.call_torch(info, tvalues, f64=True))
    pairs = [(g, w) for g, w in zip(got, want) if w.requires_grad]
    if not pairs:
        return
    ups = [np.random.default_rng(7).standard_normal(tuple(w.shape)) for _, w in pairs]
    loss = sum((g * dt.distribute_tensor(u, g.device_mesh, [dt.Replicate()] * g.device_mesh.ndim)
                ).sum() for (g, _), u in zip(pairs, ups))
    tloss = sum((w * torch.from_numpy(u)).sum() for (_, w), u in zip(pairs, ups))
    with np.errstate(all="ignore"):
        grads = dt.autograd.grad(loss, [x for _, x in leaves], allow_unused=True)
    tgrads = torch.autograd.grad(tloss, tleaves, allow_unused=True)
    for ((pi, _), leaf), g, w in zip(leaves, grads, tgrads):
        g = np.zeros(tuple(leaf.shape)) if g is None else _full(g)
        w = np.zeros(tuple(leaf.shape)) if w is None else w.numpy()
        _close(g, w, 1e-7, f"{what}: d/d{info.params[pi]}")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name", NAMES)
def test_op_matches_torch_on_random_placements(name, meshes, rng) -> None:
    for i, call in enumerate(_calls(name)):
        _check(call, meshes[i % len(meshes)], rng)
