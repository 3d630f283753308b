"""The compiled local kernels (``fastpath._kernels``) against their array-module twins.

Each compiled loop must agree with the twin dtensor runs without the extension (to a few
ulps: libm's erf/exp/tanh against numpy's), hand anything it does not serve to that twin,
and write into a given output. Skipped when the extension is not built.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import dtensor as dt
import fastpath
from dtensor.local.kernels import nn as _math_nn
from dtensor.local.kernels import pointwise as _math_pointwise
from dtensor.ops import OPS

K = fastpath.kernels
pytestmark = [
    pytest.mark.skipif(K is None, reason="compiled extension not built"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),  # NaN/inf samples in the twins
]

F32, F64 = np.dtype(np.float32), np.dtype(np.float64)
SPECIAL = [np.nan, np.inf, -np.inf, -0.0, 0.0, 1e-30, -1e-30, 5.0, -5.0, 30.0, -30.0]


def sample(shape, dtype, seed=0, special=True):
    a = np.random.default_rng(seed).standard_normal(shape) * 3
    flat = a.reshape(-1)
    if special:
        flat[: len(SPECIAL)] = SPECIAL[: flat.size]
    return a.astype(dtype)


def twin(name):
    """The array-module twin of a compiled kernel (what DTENSOR_FASTPATH=0 runs)."""
    k = {"relu": _math_pointwise.relu_kernel, "erf": _math_pointwise.erf_kernel,
         "gelu": _math_pointwise._gelu_erf, "gelu_tanh": _math_pointwise._gelu_tanh}[name]
    return k.fallback if isinstance(k, K.Unary) else k


def tol(dtype):
    return {"rtol": 4e-6, "atol": 2e-7} if dtype == F32 else {"rtol": 1e-13, "atol": 1e-15}


@pytest.mark.parametrize("dtype", [F32, F64], ids=["f32", "f64"])
@pytest.mark.parametrize("name", ["relu", "erf", "gelu", "gelu_tanh"])
def test_unary_matches_twin(name, dtype):
    kernel = K.Unary(name, twin(name))
    a = sample((5, 13), dtype)
    got = kernel(a, None)
    want = twin(name)(a, None)
    assert got.dtype == dtype and got.shape == a.shape and got.flags.c_contiguous
    np.testing.assert_allclose(got, want, equal_nan=True, **tol(dtype))
    assert not np.shares_memory(got, a)


def test_relu_semantics():
    relu = K.Unary("relu", twin("relu"))
    a = np.array([np.nan, -0.0, -1.0, 2.0, -np.inf, np.inf], np.float32)
    got = relu(a, None)
    assert np.isnan(got[0]) and got[1] == 0 and not np.signbit(got[1])
    np.testing.assert_array_equal(got[2:], [0, 2, 0, np.inf])


def test_erf_float64_matches_math_erf():
    erf = K.Unary("erf", twin("erf"))
    a = np.linspace(-7, 7, 1001)
    np.testing.assert_allclose(erf(a, None), [math.erf(v) for v in a], rtol=1e-15, atol=1e-16)


def test_unary_writes_into_out_and_in_place():
    gelu = K.Unary("gelu", twin("gelu"))
    a = sample((4, 6), F32, special=False)
    out = np.empty_like(a)
    assert gelu(a, out) is out
    np.testing.assert_allclose(out, twin("gelu")(a, None), **tol(F32))
    b = a.copy()
    assert gelu(b, b) is b  # elementwise: aliasing the input is fine
    np.testing.assert_array_equal(b, out)


class Spy:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, a, out):
        self.calls += 1
        return self.fn(a, out)


@pytest.mark.parametrize(
    "make",
    [
        lambda: (sample((6, 4), F32).T, None),  # not C-contiguous
        lambda: (sample((6, 4), np.float16), None),  # dtype without a loop
        lambda: (np.arange(12).reshape(3, 4), None),  # integers
        lambda: (sample((3, 4), F32), np.empty((3, 4), F64)),  # out of another dtype
        lambda: (sample((3, 4), F32), np.empty((3, 8), F32)[:, ::2]),  # strided out
        lambda: (sample((3, 4), F32).astype(">f4"), None),  # byte-swapped
    ],
    ids=["transposed", "float16", "int", "out-dtype", "out-strided", "swapped"],
)
def test_unserved_inputs_go_to_the_twin(make):
    a, out = make()
    spy = Spy(twin("relu"))
    got = K.Unary("relu", spy)(a, out)
    assert spy.calls == 1
    np.testing.assert_array_equal(got, np.maximum(a, 0))


def test_large_arrays_release_the_gil_and_agree():
    a = sample((300, 300), F32)  # above the no-GIL threshold
    got = K.Unary("gelu", twin("gelu"))(a, None)
    np.testing.assert_allclose(got, twin("gelu")(a, None), equal_nan=True, **tol(F32))
    sm = K.softmax_lastdim(a, False)
    np.testing.assert_allclose(sm.sum(-1)[~np.isnan(sm).any(-1)], 1, rtol=1e-5)


def test_unknown_kernel_is_rejected():
    with pytest.raises(ValueError, match="unknown kernel 'tanh'"):
        K.Unary("tanh", None)


def ref_softmax(a, log):
    with np.errstate(invalid="ignore"):
        z = a - a.max(-1, keepdims=True)
        if log:
            return z - np.log(np.exp(z).sum(-1, keepdims=True))
        e = np.exp(z)
        return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("dtype", [F32, F64], ids=["f32", "f64"])
@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (4, 1)])
def test_softmax_lastdim_matches_numpy(shape, dtype, log):
    a = sample(shape, dtype, special=False)
    got = K.softmax_lastdim(a, log)
    assert got.dtype == dtype and got.shape == a.shape
    np.testing.assert_allclose(got, ref_softmax(a.astype(F64), log), **tol(dtype))


def test_softmax_special_rows_follow_exp_of_x_minus_max():
    a = np.array([[-np.inf, -np.inf, -np.inf], [np.inf, 1, 2], [np.nan, 1, 2],
                  [1, np.nan, 2], [-np.inf, 0, 1]], np.float32)
    for log in (False, True):
        got, want = K.softmax_lastdim(a, log), ref_softmax(a, log)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_allclose(got, want, equal_nan=True, **tol(F32))


def test_softmax_lastdim_declines_what_it_does_not_serve():
    a = sample((3, 4), F32)
    assert K.softmax_lastdim(a.T, False) is None
    assert K.softmax_lastdim(np.zeros((0, 3), F32), False) is None
    assert K.softmax_lastdim(np.float32(1.0).reshape(()), False) is None
    assert K.softmax_lastdim(a.astype(np.float16), False) is None
    assert K.softmax_lastdim(a, False, np.empty((3, 4), F64)) is None
    out = np.empty_like(a)
    assert K.softmax_lastdim(a, False, out) is out


@pytest.mark.skipif(not fastpath.ENABLED, reason="kernels are used only when enabled")
def test_local_ops_use_the_compiled_kernels_and_match_the_twins():
    a = sample((4, 8), F32, special=False)
    x = dt.from_numpy(a)
    np.testing.assert_allclose(dt.gelu(x).numpy(), twin("gelu")(a, None), **tol(F32))
    np.testing.assert_allclose(dt.relu(x).numpy(), np.maximum(a, 0))
    np.testing.assert_allclose(dt.erf(x).numpy(), twin("erf")(a, None), **tol(F32))
    for dim in (-1, 0):
        np.testing.assert_allclose(dt.softmax(x, dim).numpy(), _np_softmax(a, dim), **tol(F32))
        np.testing.assert_allclose(
            dt.log_softmax(x, dim).numpy(), np.log(_np_softmax(a, dim)), rtol=1e-5, atol=1e-6
        )
    assert isinstance(OPS["relu"].function.spec.kernel, K.Unary)
    assert _math_nn._KERNELS is K


def _np_softmax(a, dim):
    e = np.exp(a - a.max(dim, keepdims=True))
    return e / e.sum(dim, keepdims=True)


_SHORT_CASES = [
    # (a, b): dtypes, 0-d, sizes around the limit, mixed dtypes, non-arrays stand-ins
    (np.ones((4, 4), F32), np.ones((4, 4), F32)),
    (np.ones((4, 4), F32), np.ones((4, 4), F64)),
    (np.ones((), F32), np.ones((), F32)),
    (np.ones((16, 16), F32), np.ones((4,), F32)),  # a at the limit (1024 bytes)
    (np.ones((4,), F32), np.ones((16, 16), F32)),  # b at the limit
    (np.ones((15, 16), F32), np.ones((16,), F32)),
    (np.ones((3,), np.int64), np.ones((3,), np.int64)),
    (np.ones((0, 3), F32), np.ones((0, 3), F32)),
]


@pytest.mark.skipif(not fastpath.AVAILABLE, reason="the compiled twins are not built")
@pytest.mark.parametrize(("a", "b"), _SHORT_CASES)
def test_short_path_condition_matches_its_reference(a, b):
    fast = frozenset([np.dtype(F32)])
    limit = 1024
    for args in ((a,), (a, b), (a, None)):
        assert K.fast_path(fast, limit, *args) is _math_pointwise.fast_path_reference(
            fast, limit, *args
        ), args
    got = K.short_binary(np.add, fast, limit, a, b)
    want = _math_pointwise.short_binary_reference(np.add, fast, limit, a, b)
    assert (got is None) == (want is None)
    if want is not None:
        np.testing.assert_array_equal(got, want)
    expect = a.ndim > 0 and a.nbytes < limit and b.nbytes < limit and a.dtype == F32
    assert (want is not None) == (expect and a.dtype is b.dtype)
