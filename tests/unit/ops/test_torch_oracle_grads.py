"""Backward formulas of the ops with many keyword arguments, against ``torch.autograd`` on the
same float64 data: every keyword and branch the op documents, not only the defaults.

- ``mse_loss``: broadcast input, broadcast target, both broadcast; every reduction (the
  mean divides by the element count of the broadcast result, not of the input);
- ``cross_entropy``: class indices with ``weight=``, ``ignore_index`` (ignored targets
  present), ``label_smoothing``, every reduction, with and without a batch dim and with
  extra dims (``(N, C, d)``); class probabilities with weight and smoothing;
- ``var`` / ``std``: ``correction=`` 0, 1 and 2 (and ``unbiased=``), ``keepdim``, ``dim``
  None, negative and a tuple.

Each case draws its data and an upstream gradient from a seed, takes the gradient of
``sum(out * upstream)`` here (``dt.autograd.grad``) and in torch, and compares.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import dtensor as dt

pytestmark = pytest.mark.torch


def _grads(fn_dt, fn_torch, arrays, seed, need=None):
    """Gradients of ``sum(fn(*inputs) * upstream)`` for the inputs ``need`` (all floats by
    default): dtensor's and torch's, as numpy arrays."""
    import torch  # lazy: the oracle (the module is marked torch)

    need = [i for i, a in enumerate(arrays) if a.dtype.kind == "f"] if need is None else need
    xs = [dt.from_numpy(a.copy()) for a in arrays]
    ts = [torch.from_numpy(a.copy()) for a in arrays]
    for i in need:
        xs[i].requires_grad_()
        ts[i].requires_grad_()
    out = fn_dt(*xs)
    with warnings.catch_warnings():  # torch warns on broadcast mse_loss
        warnings.simplefilter("ignore")
        t_out = fn_torch(*ts)
    assert tuple(out.shape) == tuple(t_out.shape)
    np.testing.assert_allclose(out.detach().numpy(), t_out.detach().numpy(), rtol=1e-12,
                               atol=1e-12)
    up = np.random.default_rng(seed + 1).standard_normal(tuple(t_out.shape))
    got = dt.autograd.grad((out * dt.from_numpy(up)).sum(), [xs[i] for i in need])
    want = torch.autograd.grad((t_out * torch.from_numpy(up)).sum(), [ts[i] for i in need])
    return [g.numpy() for g in got], [w.numpy() for w in want]


def _check(fn_dt, fn_torch, arrays, seed, need=None):
    got, want = _grads(fn_dt, fn_torch, arrays, seed, need)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, i
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12, err_msg=f"input {i}")


# -- mse_loss --------------------------------------------------------------------------------------
MSE_SHAPES = [((4, 5), (4, 5)), ((1, 5), (4, 5)), ((4, 5), (1, 5)), ((4, 1), (1, 5)),
              ((5,), (3, 2, 5)), ((), (2, 3))]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shapes", MSE_SHAPES, ids=str)
def test_mse_loss_gradients_match_torch_with_broadcasting(shapes, reduction):
    import torch.nn.functional as F  # lazy: the oracle (the module is marked torch)

    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal(s) for s in shapes]
    _check(lambda x, t: dt.mse_loss(x, t, reduction=reduction),
           lambda x, t: F.mse_loss(x, t, reduction=reduction), arrays, 1)


# -- cross_entropy ---------------------------------------------------------------------------------
def _class_targets(rng, shape, c, ignore_index):
    """Class indices of ``shape`` in [0, c), about a quarter replaced by ``ignore_index``
    (at least one ignored and one kept where there are two or more)."""
    t = rng.integers(0, c, shape)
    if ignore_index is not None and t.size >= 2:
        flat = t.reshape(-1)
        drop = rng.random(flat.size) < 0.25
        drop[0], drop[-1] = True, False
        flat[drop] = ignore_index
    return t


CE_LAYOUTS = {"batch": ((6, 5), (6,)), "no_batch": ((5,), ()), "extra_dims": ((3, 5, 4), (3, 4))}


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("ignore_index", [None, 2, -1])
@pytest.mark.parametrize("layout", sorted(CE_LAYOUTS))
def test_cross_entropy_class_index_gradients_match_torch(layout, ignore_index, weighted,
                                                         smoothing, reduction):
    import torch.nn.functional as F  # lazy: the oracle (the module is marked torch)

    xshape, tshape = CE_LAYOUTS[layout]
    c = 5
    rng = np.random.default_rng(7)
    x = rng.standard_normal(xshape)
    t = _class_targets(rng, tshape, c, ignore_index)
    w = rng.uniform(0.2, 3.0, c)
    kw = {"reduction": reduction, "label_smoothing": smoothing}
    if ignore_index is not None:
        kw["ignore_index"] = ignore_index
    if weighted:
        _check(lambda a, b, ww: dt.cross_entropy(a, b, weight=ww, **kw),
               lambda a, b, ww: F.cross_entropy(a, b, weight=ww, **kw), [x, t, w], 2, need=[0])
    else:
        _check(lambda a, b: dt.cross_entropy(a, b, **kw),
               lambda a, b: F.cross_entropy(a, b, **kw), [x, t], 2, need=[0])


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.3])
@pytest.mark.parametrize("weighted", [False, True])
def test_cross_entropy_probability_target_gradients_match_torch(weighted, smoothing,
                                                                reduction):
    import torch.nn.functional as F  # lazy: the oracle (the module is marked torch)

    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 5, 3))
    q = rng.uniform(0, 1, (4, 5, 3))
    q /= q.sum(axis=1, keepdims=True)
    w = rng.uniform(0.2, 3.0, 5)
    kw = {"reduction": reduction, "label_smoothing": smoothing}
    if weighted:
        _check(lambda a, b, ww: dt.cross_entropy(a, b, weight=ww, **kw),
               lambda a, b, ww: F.cross_entropy(a, b, weight=ww, **kw), [x, q, w], 4, need=[0])
    else:
        _check(lambda a, b: dt.cross_entropy(a, b, **kw),
               lambda a, b: F.cross_entropy(a, b, **kw), [x, q], 4, need=[0])


# -- var / std -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["var", "std"])
@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("dim", [None, 0, -1, (0, 2), (-1, -3)], ids=str)
@pytest.mark.parametrize("correction", [0, 1, 2, "unbiased=False", "default"])
def test_var_std_gradients_match_torch(name, correction, dim, keepdim):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 3, 5))
    if correction == "default":
        kw = {}
    elif correction == "unbiased=False":
        kw = {"unbiased": False}
    else:
        kw = {"correction": correction}
    if dim is None and keepdim:
        kw_dim = {"dim": None, "keepdim": True}
    elif dim is None:
        kw_dim = {}
    else:
        kw_dim = {"dim": dim, "keepdim": keepdim}
    _check(lambda a: getattr(a, name)(**kw_dim, **kw),
           lambda a: getattr(a, name)(**kw_dim, **kw), [x], 6)
