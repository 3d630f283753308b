"""The fused gradients of gelu and layer_norm and the one-pass Adam(W) step: the compiled
loops against their array-module twins, and (where torch is installed) against
``torch.autograd`` and ``torch.optim``."""

from __future__ import annotations

import numpy as np
import pytest

import dtensor as dt
import fastpath as _fp
from dtensor.local.kernels import nn as knn
from dtensor.local.kernels import pointwise as kpw
from dtensor.optim import _optimizers

TOL = {np.float32: {"rtol": 2e-5, "atol": 1e-5}, np.float64: {"rtol": 1e-12, "atol": 1e-13}}
DTYPES = (np.float32, np.float64)


def _data(shape, dtype, seed, strided: bool):
    """Random data of ``shape``; with ``strided`` a non-contiguous view (a transpose)."""
    rng = np.random.default_rng(seed)
    if strided:
        return (rng.standard_normal(shape[::-1]) * 2).astype(dtype).T
    return (rng.standard_normal(shape) * 2).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("strided", [False, True])
def test_gelu_backward_matches_its_twin(dtype, approximate, strided):
    x = _data((37, 29), dtype, 1, strided)
    g = _data((37, 29), dtype, 2, False)
    got = dt._gelu_backward(dt.tensor(g), dt.from_numpy(x), approximate).numpy()
    want = kpw._gelu_backward_twin(g, x, approximate == "tanh")
    assert got.dtype == dtype and got.shape == x.shape
    np.testing.assert_allclose(got, want, **TOL[dtype])


def test_gelu_backward_bad_input():
    x = dt.ones(3, 4)
    with pytest.raises(Exception, match="gelu_backward: approximate"):
        dt._gelu_backward(x, x, "erf")
    with pytest.raises(Exception, match=r"gelu_backward.*\[3, 4\]"):
        dt._gelu_backward(dt.ones(4, 3), x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("strided", [False, True])
def test_layer_norm_backward_matches_its_twin(dtype, weighted, strided):
    x = _data((3, 11, 40), dtype, 3, strided)
    g = _data((3, 11, 40), dtype, 4, False)
    w = _data((40,), dtype, 5, False) if weighted else None
    gx, gw = dt._layer_norm_backward(dt.tensor(g), dt.from_numpy(x), (40,),
                                     None if w is None else dt.tensor(w), 1e-5)
    wx, ww = knn._layer_norm_backward_twin(g, x, (40,), w, 1e-5)
    assert gx.dtype == dtype and tuple(gw.shape) == (40,)
    np.testing.assert_allclose(gx.numpy(), wx, **TOL[dtype])
    np.testing.assert_allclose(gw.numpy(), ww, rtol=TOL[dtype]["rtol"] * 10,
                               atol=TOL[dtype]["atol"] * 10)


def _torch_grads(fn_t, x, g, extra=()):
    import torch  # lazy: optional oracle

    xt = torch.tensor(np.ascontiguousarray(x), requires_grad=True)
    ext = [torch.tensor(e, requires_grad=True) for e in extra]
    fn_t(xt, *ext).backward(torch.tensor(g))
    return [xt.grad.numpy()] + [e.grad.numpy() for e in ext]


def _dt_grads(fn_d, x, g, extra=()):
    xd = dt.from_numpy(x).requires_grad_()
    ed = [dt.tensor(e).requires_grad_() for e in extra]
    (fn_d(xd, *ed) * dt.tensor(g)).sum().backward()
    return [xd.grad.numpy()] + [e.grad.numpy() for e in ed]


@pytest.mark.torch
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("strided", [False, True])
def test_gelu_grad_matches_torch(dtype, approximate, strided):
    import torch  # lazy: optional oracle

    x = _data((33, 65), dtype, 6, strided)
    g = _data((33, 65), dtype, 7, False)
    got = _dt_grads(lambda a: dt.nn.functional.gelu(a, approximate=approximate), x, g)
    want = _torch_grads(lambda a: torch.nn.functional.gelu(a, approximate=approximate), x, g)
    np.testing.assert_allclose(got[0], want[0], **TOL[dtype])


@pytest.mark.torch
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("affine", ["none", "weight", "both"])
@pytest.mark.parametrize("strided", [False, True])
def test_layer_norm_grad_matches_torch(dtype, affine, strided):
    import torch  # lazy: optional oracle

    x = _data((4, 9, 48), dtype, 8, strided)
    g = _data((4, 9, 48), dtype, 9, False)
    extra = [_data((48,), dtype, 10, False), _data((48,), dtype, 11, False)]
    extra = {"none": [], "weight": extra[:1], "both": extra}[affine]
    got = _dt_grads(lambda a, *wb: dt.nn.functional.layer_norm(a, (48,), *wb), x, g, extra)
    want = _torch_grads(lambda a, *wb: torch.nn.functional.layer_norm(a, (48,), *wb), x, g,
                        extra)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=TOL[dtype]["rtol"] * 5,
                                   atol=TOL[dtype]["atol"] * 20)


def _run_adam(cls, p0, grads, kw):
    p = dt.tensor(p0.copy()).requires_grad_()
    opt = getattr(dt.optim, cls)([p], lr=0.01, **kw)
    for g in grads:
        p.grad = dt.tensor(g)
        opt.step()
    return p.detach().numpy(), opt.state[p]["exp_avg_sq"].numpy()


_ADAM_CASES = [("AdamW", {"weight_decay": 0.1}), ("AdamW", {"maximize": True}),
               ("Adam", {"weight_decay": 0.05}), ("Adam", {})]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cls,kw", _ADAM_CASES)
def test_fused_adam_matches_the_op_path(dtype, cls, kw, monkeypatch):
    rng = np.random.default_rng(12)
    p0 = rng.standard_normal((13, 7)).astype(dtype)
    grads = [rng.standard_normal((13, 7)).astype(dtype) for _ in range(6)]
    fused = _run_adam(cls, p0, grads, kw)
    monkeypatch.setattr(_optimizers, "_KERNELS", None)
    ops = _run_adam(cls, p0, grads, kw)
    for a, b in zip(fused, ops, strict=True):
        np.testing.assert_allclose(a, b, **TOL[dtype])


@pytest.mark.skipif(not _fp.ENABLED, reason="compiled fast path not enabled (not built or disabled)")
def test_fused_adam_serves_plain_arrays_only():
    p = np.zeros(6, np.float32)
    m, v = np.zeros(6, np.float32), np.zeros(6, np.float32)
    assert _fp.kernels.adam_step(p, np.ones(6, np.float32), m, v, 1, 0, 1, .9, .999, .1, 1,
                                 1e-8)
    assert np.allclose(m, 0.1) and np.all(p < 0)
    before = p.copy()
    assert not _fp.kernels.adam_step(p, np.ones(6), m, v, 1, 0, 1, .9, .999, .1, 1, 1e-8)
    assert not _fp.kernels.adam_step(p, np.ones(12, np.float32)[::2], m, v, 1, 0, 1, .9,
                                     .999, .1, 1, 1e-8)
    np.testing.assert_array_equal(p, before)


@pytest.mark.torch
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cls,kw", _ADAM_CASES)
def test_adam_matches_torch(dtype, cls, kw):
    import torch  # lazy: optional oracle

    rng = np.random.default_rng(13)
    p0 = rng.standard_normal((13, 7)).astype(dtype)
    grads = [rng.standard_normal((13, 7)).astype(dtype) for _ in range(6)]
    got, got_v = _run_adam(cls, p0, grads, kw)
    tp = torch.tensor(p0.copy(), requires_grad=True)
    opt = getattr(torch.optim, cls)([tp], lr=0.01, **kw)
    for g in grads:
        tp.grad = torch.tensor(g)
        opt.step()
    np.testing.assert_allclose(got, tp.detach().numpy(), **TOL[dtype])
    np.testing.assert_allclose(got_v, opt.state[tp]["exp_avg_sq"].numpy(), **TOL[dtype])
