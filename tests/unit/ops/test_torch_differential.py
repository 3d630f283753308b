"""Every record of the op table against torch, generated from the table: forward and backward
on every sample call (:func:`dtensor.validate.sample_calls`), on local tensors.

- forward: the op through its public form (``dt.<name>``, the method, ``x[idx]``) on the
  call's data, against its torch counterpart (:data:`helpers.torch_ops.TORCH`) on the same
  data: dtype, shape and values (exact for ints and bools, NaN and inf where torch has them);
- backward: the float inputs as float64 leaves, a random upstream gradient per float output;
  ``dt.autograd.grad`` against ``torch.autograd.grad`` (``requires_grad`` of each output
  agrees with torch too, so a non-differentiable op must give outputs that require none);
- coverage: every record has an oracle and sample calls covering its keyword arguments and
  branches (:func:`helpers.torch_ops.requirements`); a record without them fails
  ``test_every_record_has_an_oracle_and_full_coverage``, so a new op brings its samples.
"""

from __future__ import annotations

import functools
import zlib

import numpy as np
import pytest
from helpers import torch_ops as T

import dtensor as dt
from dtensor.ops import NOT_DIFFERENTIABLE, OPS
from dtensor.validate import SampleCall, sample_calls

pytestmark = pytest.mark.torch

NAMES = sorted(OPS)


@functools.cache
def _calls(name: str) -> list[SampleCall]:
    return sample_calls(OPS[name], seed=zlib.crc32(name.encode()))


def _by_name(call: SampleCall) -> dict:
    return dict(zip(call.info.params, call.values))


def test_every_record_has_an_oracle_and_full_coverage():
    """Every record has a torch counterpart (or a numpy oracle) and sample calls covering its
    requirements, except the gaps recorded in ``COVERAGE_GAPS`` (exactly those: a filled gap
    must leave the table, a new record must bring full coverage)."""
    problems = []
    for name in NAMES:
        info = OPS[name]
        if name not in T.TORCH:
            problems.append(f"{name}: no torch counterpart or numpy oracle in helpers/torch_ops")
        calls = _calls(name)
        if not calls:
            problems.append(f"{name}: no sample calls")
            continue
        missing = T.missing_coverage(info, [_by_name(c) for c in calls])
        if tuple(missing) != T.COVERAGE_GAPS.get(name, ()):
            problems.append(f"{name} ({info.samples}): samples lack {', '.join(missing)}")
    assert not problems, "\n".join(problems)


def test_the_coverage_check_fails_a_record_without_coverage():
    """A record whose samples miss a keyword, ``dim=None`` or NaN is reported, by name."""
    info = OPS["sum"]
    plain = [{"input": np.ones((2, 3), np.float32), "dim": 0, "keepdim": False,
              "dtype": None}]
    missing = T.missing_coverage(info, plain)
    for need in ("keepdim!=default", "dtype!=default", "dim=None", "dim<0", "dim=tuple",
                 "nan", "inf", "int", "empty", "size-1"):
        assert need in missing, need
    full = [{"input": np.array([[np.nan, np.inf]]), "dim": None, "keepdim": True,
             "dtype": np.dtype(np.float64)},
            {"input": np.zeros((0, 3), np.int64), "dim": (0, -1), "keepdim": False,
             "dtype": None},
            {"input": np.ones((2, 3), np.float32), "dim": -1, "keepdim": False, "dtype": None}]
    assert T.missing_coverage(info, full) == []


# -- the differential checks ----------------------------------------------------------------------
def test_each_op_runs_through_the_table_of_torch_counterparts():
    """The default counterpart is torch's function of the same name: a record whose name torch
    lacks needs an entry (checked by running it: a lookup failure is an AttributeError)."""
    torch = T.torch_module()
    for name, info in OPS.items():
        base = name[:-1] if info.inplace else name
        if T.TORCH[name].__qualname__.startswith("_default_fn"):
            assert hasattr(torch, base) or hasattr(torch.Tensor, name), name


def _dt_values(call: SampleCall, f64: bool, grad: bool) -> tuple[list, list]:
    """The call's values with dtensor tensors in the tensor slots (floats as float64 leaves
    that require grad if ``grad``); the leaves as (parameter, tensor)."""
    values = [list(v) if isinstance(v, list) else v for v in call.values]
    leaves = []
    for pi, ei in call.slots:
        v = call.arg((pi, ei))
        if not isinstance(v, np.ndarray):
            continue
        param = call.info.params[pi]
        a = v.astype(np.float64) if f64 and v.dtype.kind == "f" else v.copy()
        t = dt.from_numpy(a)
        if grad and a.dtype.kind == "f" and (call.info.name.rstrip("_"), param) not in T.NO_GRAD:
            t.requires_grad_()
            leaves.append(((pi, ei), t))
            if call.info.inplace and pi == 0:
                t = t.clone()
        if ei < 0:
            values[pi] = t
        else:
            values[pi][ei] = t
    return values, leaves


def _torch_values(call: SampleCall, leaves_dt: list) -> tuple[list, list]:
    """The call's values for torch (numpy floats as float64), the leaves as torch tensors
    that require grad (the same parameters as dtensor's)."""
    torch = T.torch_module()
    slots = [s for s, _ in leaves_dt]
    values = [list(v) if isinstance(v, list) else v for v in call.values]
    leaves = []
    for pi, ei in slots:
        v = call.arg((pi, ei))
        t = torch.from_numpy(v.astype(np.float64)).requires_grad_()
        leaves.append(t)
        if ei < 0:
            values[pi] = t
        else:
            values[pi][ei] = t
    return values, leaves


def _tolerance(dtype: np.dtype) -> float:
    name = np.dtype(dtype).name
    return {"float64": 1e-9, "float32": 2e-5, "float16": 2e-3, "bfloat16": 2e-2}.get(name, 0.0)


def _np(o) -> np.ndarray:
    torch = T.torch_module()
    if isinstance(o, torch.Tensor):
        o = o.detach()
        if o.dtype == torch.bfloat16:
            return o.float().numpy().astype(dt.bfloat16)
        return o.numpy()
    if isinstance(o, (dt.Tensor, dt.DTensor)):
        o = o.full_tensor() if isinstance(o, dt.DTensor) else o
        return o.detach().numpy()
    return np.asarray(o)


def _outs(out) -> list:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def compare(call: SampleCall, got, want, what: str, tol: float | None = None) -> None:
    """dtensor's outputs ``got`` against torch's ``want``: count, dtype, shape, values."""
    gs, ws = _outs(got), _outs(want)
    assert len(gs) == len(ws), f"{what}: {len(gs)} outputs, torch gives {len(ws)}"
    ties = call.info.name.rstrip("_") in T.TIES
    for k, (g, w) in enumerate(zip(gs, ws)):
        g, w = _np(g), _np(w)
        assert g.dtype.name == w.dtype.name, f"{what}: output {k} dtype {g.dtype}, torch {w.dtype}"
        assert g.shape == w.shape, f"{what}: output {k} shape {g.shape}, torch {w.shape}"
        if g.dtype.kind == "f" or g.dtype.name == "bfloat16":
            t = _tolerance(g.dtype) if tol is None else tol
            a, b = g.astype(np.float64), w.astype(np.float64)
            ok = np.isclose(a, b, rtol=t, atol=t, equal_nan=True)
            if not ok.all():
                bad = np.argwhere(~ok)[:3].tolist()
                raise AssertionError(f"{what}: output {k} differs at {bad}: {a[~ok][:3]}, "
                                     f"torch {b[~ok][:3]} (tol {t})")
        elif not np.array_equal(g, w):
            if ties and g.dtype.kind == "i" and T.same_values_at(call, g, w):
                continue
            raise AssertionError(f"{what}: output {k} differs:\n{g}\ntorch\n{w}")


def _bool_as_uint8(info, call: SampleCall, got) -> object:
    """torch on the call's bool arrays as uint8 (:data:`helpers.torch_ops.BOOL_AS_UINT8`),
    uint8 outputs cast back to bool."""
    torch = T.torch_module()
    values = [v.astype(np.uint8) if isinstance(v, np.ndarray) and v.dtype == bool else v
              for v in call.values]
    out = T.call_torch(info, values)
    outs = [o.bool() if o.dtype == torch.uint8 else o for o in _outs(out)]
    return outs if isinstance(out, (tuple, list)) else outs[0]


def _numpy_indexing(call: SampleCall) -> bool:
    """An index with an int and an array separated by a slice (:data:`NUMPY_INDEXING`)."""
    idx = call.values[1]
    if not isinstance(idx, tuple):
        return False
    kinds = ["a" if isinstance(e, (np.ndarray, list)) else "i" if isinstance(e, int)
             else "s" for e in idx]
    adv = [k for k, c in enumerate(kinds) if c in "ai"]
    return "a" in kinds and "i" in kinds and adv[-1] - adv[0] + 1 != len(adv)


def _numpy_order(call: SampleCall, out):
    """torch's result of such an index reordered as numpy orders it: the broadcast dims of
    the advanced indices first (torch puts them where the first array index stands once the
    ints have selected)."""
    idx = call.values[1]
    rest = [e for e in idx if not isinstance(e, int)]
    first = next(k for k, e in enumerate(rest) if isinstance(e, (np.ndarray, list)))
    nb = np.broadcast_shapes(*(np.shape(e) for e in idx
                               if isinstance(e, (np.ndarray, list, int)))).__len__()
    return out.movedim(tuple(range(first, first + nb)), tuple(range(nb)))


def _upstream(outs: list, seed: int) -> list:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(tuple(o.shape)) for o in outs]


def check_call(call: SampleCall, seed: int) -> None:
    """Forward on the call's data, then backward on float64 leaves, against torch."""
    info = call.info
    torch = T.torch_module()
    what = f"{info.name} {call.label}"
    keep = T.keep_mask(call)
    # forward in the call's dtypes
    values, _ = _dt_values(call, f64=False, grad=False)
    dt.set_rng_state(call.rng_state)
    with np.errstate(all="ignore"):
        got = T.call_dt(info, values)
    base = info.name.rstrip("_")
    numpy_rule = base == "getitem" and _numpy_indexing(call)
    try:
        want = T.call_torch(info, call.values, keep=keep)
        want = _numpy_order(call, want) if numpy_rule else want
    except (RuntimeError, NotImplementedError):
        if base not in T.BOOL_AS_UINT8:
            raise
        want = _bool_as_uint8(info, call, got)
    compare(call, got, want, what)
    if info.inplace and info.backward is NOT_DIFFERENTIABLE:
        return  # the in-place form refuses a tensor that requires grad
    if info.name.startswith("_") or not any(
            isinstance(call.arg(s), np.ndarray) and call.arg(s).dtype.kind == "f"
            for s in call.slots):
        return
    # backward: float64 leaves
    values, leaves = _dt_values(call, f64=True, grad=True)
    tvalues, tleaves = _torch_values(call, leaves)
    dt.set_rng_state(call.rng_state)
    with np.errstate(all="ignore"):
        got = _outs(T.call_dt(info, values))
    want = T.call_torch(info, tvalues, f64=True, keep=keep)
    want = _outs(_numpy_order(call, want) if numpy_rule else want)
    compare(call, got, want, what + " (float64)")
    for k, (g, w) in enumerate(zip(got, want)):
        req = bool(getattr(g, "requires_grad", False))
        if base in T.ZERO_GRAD_IN_TORCH and w.requires_grad:
            continue  # torch: requires grad, its derivative zero or "not implemented"
        assert req == bool(w.requires_grad), (
            f"{what}: output {k} requires_grad={req}, torch {w.requires_grad}")
    if info.backward is NOT_DIFFERENTIABLE or not leaves:
        return
    pairs = [(g, w) for g, w in zip(got, want) if w.requires_grad]
    if not pairs:
        return
    ups = _upstream([w for _, w in pairs], seed)
    loss = sum(((g * dt.from_numpy(u)).sum() for (g, _), u in zip(pairs, ups)),
               dt.zeros((), dtype=np.float64))
    tloss = sum((w * torch.from_numpy(u)).sum() for (_, w), u in zip(pairs, ups))
    with np.errstate(all="ignore"):
        grads = dt.autograd.grad(loss, [t for _, t in leaves], allow_unused=True)
    tgrads = torch.autograd.grad(tloss, tleaves, allow_unused=True)
    for ((pi, ei), leaf), g, w in zip(leaves, grads, tgrads):
        param = info.params[pi] + ("" if ei < 0 else f"[{ei}]")
        g = np.zeros(tuple(leaf.shape)) if g is None else g.numpy()
        w = np.zeros(tuple(leaf.shape)) if w is None else w.numpy()
        assert g.shape == w.shape, f"{what}: d/d{param} shape {g.shape}, torch {w.shape}"
        ok = np.isclose(g, w, rtol=1e-7, atol=1e-9, equal_nan=True)
        if (base, info.params[pi]) in T.GRAD_DIFFERS:
            mask = T.grad_mask(call, info.params[pi], g)
            ok |= ~mask if mask is not None else False
        if not ok.all():
            bad = np.argwhere(~ok)[:3].tolist()
            raise AssertionError(f"{what}: d/d{param} differs at {bad}: {g[~ok][:3]}, torch "
                                 f"{w[~ok][:3]}")


@pytest.mark.parametrize("name", NAMES)
def test_op_matches_torch(name):
    calls = _calls(name)
    assert calls, name
    for i, call in enumerate(calls):
        check_call(call, seed=i)


# -- regressions found by the differential check ---------------------------------------------------
@pytest.mark.parametrize("mode", ["floor", "trunc"])
def test_div_with_rounding_mode_has_a_zero_gradient_as_in_torch(mode):
    """div(rounding_mode=...) is piecewise constant: torch's gradient is zero (dtensor gave
    the true division's)."""
    torch = T.torch_module()
    a, b = np.random.default_rng(0).standard_normal((2, 3, 4)) + 3.0
    x, y = dt.from_numpy(a).requires_grad_(), dt.from_numpy(b).requires_grad_()
    gx, gy = dt.autograd.grad(dt.div(x, y, rounding_mode=mode).sum(), [x, y])
    tx, ty = torch.from_numpy(a).requires_grad_(), torch.from_numpy(b).requires_grad_()
    wx, wy = torch.autograd.grad(torch.div(tx, ty, rounding_mode=mode).sum(), [tx, ty])
    np.testing.assert_array_equal(gx.numpy(), wx.numpy())
    np.testing.assert_array_equal(gy.numpy(), wy.numpy())


def test_cat_with_a_legacy_empty_tensor_differentiates():
    """cat([empty 1-D, (4, 3)]) (PyTorch skips the legacy empty tensor): the backward gave the
    empty tensor a slice of the gradient and failed to reshape it."""
    torch = T.torch_module()
    a, b = np.zeros((0,)), np.random.default_rng(1).standard_normal((4, 3))
    up = np.random.default_rng(2).standard_normal((4, 3))
    x, y = dt.from_numpy(a).requires_grad_(), dt.from_numpy(b).requires_grad_()
    gx, gy = dt.autograd.grad((dt.cat([x, y], 0) * dt.from_numpy(up)).sum(), [x, y])
    tx, ty = torch.from_numpy(a).requires_grad_(), torch.from_numpy(b).requires_grad_()
    wx, wy = torch.autograd.grad((torch.cat([tx, ty], 0) * torch.from_numpy(up)).sum(),
                                 [tx, ty])
    assert tuple(gx.shape) == tuple(wx.shape) == (0,)
    np.testing.assert_array_equal(gy.numpy(), wy.numpy())


def _grads_vs_torch(fn_dt, fn_torch, *arrays, up_seed=3):
    """d(sum(fn(*arrays) * u))/d(arrays) of dtensor and of torch (float64), as numpy."""
    torch = T.torch_module()
    xs = [dt.from_numpy(a.copy()).requires_grad_() for a in arrays]
    ts = [torch.from_numpy(a.copy()).requires_grad_() for a in arrays]
    out, tout = fn_dt(*xs), fn_torch(*ts)
    u = np.random.default_rng(up_seed).standard_normal(tuple(tout.shape))
    got = dt.autograd.grad((out * dt.from_numpy(u)).sum(), xs)
    want = torch.autograd.grad((tout * torch.from_numpy(u)).sum(), ts)
    return [g.numpy() for g in got], [w.numpy() for w in want]


@pytest.mark.filterwarnings("ignore:(var|std)... degrees of freedom:UserWarning")
@pytest.mark.parametrize("name", ["var", "std"])
def test_var_and_std_differentiate_with_a_correction_equal_to_the_count(name):
    """correction == the reduced count: the backward raised ZeroDivisionError; torch gives
    the division by zero's inf (var) and NaN (std, inf/inf)."""
    torch = T.torch_module()
    a = np.array([[1.0, 2.0], [3.0, 5.0]])
    got, want = _grads_vs_torch(lambda x: getattr(dt, name)(x, dim=1, correction=2),
                                lambda x: getattr(torch, name)(x, dim=1, correction=2), a)
    np.testing.assert_array_equal(got[0], want[0])
    assert np.isinf(got[0]).all() if name == "var" else np.isnan(got[0]).all()


def test_relu_and_softplus_pass_the_gradient_at_nan_as_torch():
    """relu's gradient at a NaN input was 0 (out > 0 fails), softplus's finite (its linear
    branch's test fails too); torch gives the upstream gradient and NaN."""
    torch = T.torch_module()
    a = np.array([np.nan, -1.0, 2.0, np.inf, -np.inf])
    got, want = _grads_vs_torch(dt.relu, torch.relu, a)
    np.testing.assert_array_equal(got[0], want[0])
    assert got[0][0] != 0
    soft = (lambda x: dt.softplus(x, beta=2.0, threshold=1.0),
            lambda x: torch.nn.functional.softplus(x, beta=2.0, threshold=1.0))
    got, want = _grads_vs_torch(*soft, a)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-12, atol=0)
    assert np.isnan(got[0][0])


@pytest.mark.parametrize("name", ["maximum", "minimum"])
def test_maximum_and_minimum_give_a_nan_result_gradient_to_both_as_torch(name):
    """Where either argument is NaN torch gives both the whole gradient; dtensor gave it to
    one; ties still split it in halves."""
    torch = T.torch_module()
    a = np.array([[np.nan, 1.0, 2.0], [0.5, np.inf, -3.0]])
    b = np.array([[1.0, np.nan, 2.0], [-0.5, 1.0, np.nan]])
    got, want = _grads_vs_torch(getattr(dt, name), getattr(torch, name), a, b)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("name", ["max", "min"])
def test_max_and_min_over_a_dim_give_a_nan_row_gradient_to_the_nan(name):
    """max/min(dim) of a row with a NaN: the NaN is the result and torch's gradient goes to
    it; dtensor's mask (x == result) was empty there, and its gradient NaN for the whole
    row."""
    torch = T.torch_module()
    a = np.array([[1.0, np.nan, 3.0], [2.0, -1.0, 0.5], [np.inf, -np.inf, 0.0]])
    got, want = _grads_vs_torch(lambda x: getattr(dt, name)(x, dim=1)[0],
                                lambda x: getattr(torch, name)(x, dim=1)[0], a)
    np.testing.assert_array_equal(got[0], want[0])
    assert got[0][0, 1] != 0 and got[0][0, 0] == got[0][0, 2] == 0
