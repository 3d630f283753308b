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
from dtensor.local.kernels import reduce as _math_reduce
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


def alloc_none(shape, dtype, like):
    """An output policy that leaves the allocation to numpy (it answers None)."""


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
    assert K.softmax_lastdim(a, False, lambda s, d, like: np.empty((3, 4), F64)) is None
    assert K.softmax_lastdim(a, False, lambda s, d, like: np.empty((3, 8), F32)[:, ::2]) is None
    ro = np.empty_like(a)
    ro.flags.writeable = False
    assert K.softmax_lastdim(a, False, lambda s, d, like: ro) is None
    out = np.empty_like(a)
    assert K.softmax_lastdim(a, False, lambda s, d, like: out) is out
    assert K.softmax_lastdim(a.astype(F64), False, alloc_none).dtype == F64


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


# ---------------------------------------------------------------- float32 vectorised loops
# The float32 loops evaluate exp, erf and tanh as polynomials (fastpath/_kernels_simd.pxi);
# these tests hold them to a few ulps of float64 references over dense grids.


def ulps(got, want):
    """|got - want| in units of the float32 spacing at ``want`` (a float64 reference)."""
    spacing = np.spacing(np.abs(want).astype(F32)).astype(F64)
    return np.abs(got.astype(F64) - want) / spacing


def dense(lo, hi, n=400_001):
    return np.linspace(lo, hi, n).astype(F32)


def test_erf_float32_is_within_two_ulps():
    a = np.concatenate([dense(-6, 6), np.float32([1e-30, -1e-30, 1e-40, 3.9, 3.92, 4.0])])
    got = K.Unary("erf", twin("erf"))(a, None)
    want = np.array([math.erf(v) for v in a.astype(F64)])
    assert ulps(got, want).max() <= 2
    special = K.Unary("erf", twin("erf"))(np.float32([np.nan, np.inf, -np.inf, -0.0]), None)
    assert np.isnan(special[0]) and list(special[1:3]) == [1, -1]
    assert special[3] == 0 and np.signbit(special[3])


def gelu_reference(a):
    x = a.astype(F64)
    phi = np.array([math.erfc(-v / math.sqrt(2)) for v in x.ravel()]).reshape(x.shape)
    return 0.5 * x * phi


def test_gelu_float32_is_within_a_few_ulps():
    gelu = K.Unary("gelu", twin("gelu"))
    pos = dense(0, 12, 200_001)
    assert ulps(gelu(pos, None), gelu_reference(pos)).max() <= 3
    neg = dense(-5.5, 0, 200_001)
    np.testing.assert_allclose(gelu(neg, None), gelu_reference(neg), rtol=1e-5, atol=1e-30)
    special = gelu(np.float32([np.nan, np.inf, -np.inf, -0.0, -30.0, 1e-30]), None)
    assert np.isnan(special[0]) and special[1] == np.inf and np.isnan(special[2])
    assert special[3] == 0 and np.signbit(special[3])  # -0 stays -0, as in x * Phi(x)
    assert special[4] == 0 and special[5] == np.float32(5e-31)


def test_gelu_tanh_float32_matches_its_formula_in_float64():
    a = dense(-12, 12)
    x = a.astype(F64)
    want = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    got = K.Unary("gelu_tanh", twin("gelu_tanh"))(a, None)
    # 1 + tanh cancels for negative x in any float32 evaluation: a term of |x| ulps of 1/2
    bound = 2 * np.spacing(np.abs(want).astype(F32)) + 6e-8 * np.abs(x)
    np.testing.assert_array_less(np.abs(got - want), bound)


def softmax64(a, log):
    return ref_softmax(a.astype(F64), log)


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("n", [3, 100, 5000], ids=["short", "long", "chunked"])
def test_softmax_float32_special_rows(n, log):
    """Rows of every length class (grouped short rows, one pass per long row, log_softmax's
    chunked exp) with huge logits, -inf, +inf, NaN and exponents far below -87 (subnormal
    and zero results)."""
    rows = np.full((8, n), -1.0, F32)
    rows[0, :2] = [1e30, -1e30]
    rows[1, :] = -np.inf
    rows[2, :2] = [np.inf, 0]
    rows[3, 1] = np.nan
    rows[4, :] = -np.inf
    rows[4, :3] = [0, -100, -110]  # e^-100 is subnormal, e^-110 rounds to 0
    rows[5, :2] = [-np.inf, 5]
    rows[6, :] = np.linspace(-200, 0, n)
    got, want = K.softmax_lastdim(rows, log), softmax64(rows, log)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=4e-6, atol=0 if log else 3e-45)
    if not log:
        assert got[4, 1] > 0 and got[4, 2] == 0


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("shape", [(700, 7), (33, 64), (5, 1000), (2, 9000)])
def test_softmax_float32_matches_float64(shape, log):
    a = sample(shape, F32, seed=3, special=False) * 10
    np.testing.assert_allclose(K.softmax_lastdim(a, log), softmax64(a, log),
                               rtol=4e-6, atol=1e-7 if log else 1e-12)


# ------------------------------------------------------------------------------ reductions
REDUCE_SHAPES = [(1,), (7,), (3, 5), (4, 1), (2, 3, 40), (3, 127), (3, 129), (2, 1000),
                 (1, 4096), (2, 4097), (1, 70_003), (64, 64)]


U32 = 2.0 ** -24  # float32 unit roundoff


def assert_sum_close(got, a, axis, count=None):
    """``got`` (a float32 sum over ``axis``, or that sum / ``count`` in float32) within the
    lanes summation's bound of the exact float64 sum: 21 u sum(|x|) (the lanes and the tree),
    plus one rounding of the result (and one of the division)."""
    exact = a.astype(F64).sum(axis=axis)
    bound = 21 * U32 * np.abs(a.astype(F64)).sum(axis=axis) + 2 * U32 * np.abs(exact)
    if count is not None:
        exact, bound = exact / count, bound / count + U32 * np.abs(exact / count)
    err = np.abs(np.asarray(got, F64).reshape(np.shape(exact)) - exact)
    assert (err <= bound).all(), float(np.max(err - bound))


@pytest.mark.mode_independent
@pytest.mark.parametrize("shape", REDUCE_SHAPES)
def test_sum_and_mean_match_numpy_within_rounding(shape):
    """The compiled sums (float32 lanes, float64 block totals) against the exact sum and
    numpy's pairwise one: within float32 rounding, not to the bit (below 16 elements, to the
    bit); every way of naming the last (or every) axis gives the same bytes."""
    rng = np.random.default_rng(sum(shape))
    a = (rng.standard_normal(shape) * 10.0 ** rng.uniform(-3, 3, shape)).astype(F32)
    last = [-1, a.ndim - 1, (-1,), [a.ndim - 1]]
    every = [None, (), tuple(range(a.ndim)), list(range(a.ndim))[::-1]]
    for keepdim in (False, True):
        for dims, axis in ((last, -1), (every, None)):
            sums = [K.reduce_lastdim("sum", a, d, keepdim, None, alloc_none) for d in dims]
            means = [K.reduce_lastdim("mean", a, d, keepdim, F32, alloc_none) for d in dims]
            want = np.asarray(np.sum(a, axis=axis, keepdims=keepdim))
            for got in sums + means:
                assert got.dtype == F32 and got.shape == want.shape
            assert len({g.tobytes() for g in sums}) == 1 and len({g.tobytes() for g in means}) == 1
            assert_sum_close(sums[0], a, axis)
            count = a.size if axis is None else a.shape[-1]
            assert_sum_close(means[0], a, axis, count)
            # numpy's pairwise sum obeys a similar bound: the two agree within twice it
            np.testing.assert_allclose(sums[0], want, rtol=0,
                                       atol=float(np.max(50 * U32 * np.abs(a).sum(axis=axis))))
            np.testing.assert_array_equal(means[0], sums[0] / np.float32(count))
            if count < 16:  # fewer than the 16 lanes: numpy's order, to the bit
                assert sums[0].tobytes() == want.tobytes()


@pytest.mark.mode_independent
def test_sums_of_large_and_cancelling_values():
    """Large magnitudes (overflow to inf where the float32 sum does), cancellation and
    subnormals: the bound holds, infinities appear where every order gives them."""
    rng = np.random.default_rng(1)
    big = (rng.standard_normal((4, 1000)) * 1e36).astype(F32)  # sum(|x|) ~ 8e38: no overflow
    assert_sum_close(K.reduce_lastdim("sum", big, -1, False, None, alloc_none), big, -1)
    over = np.full((2, 40), 3e38, F32)
    over[1] *= -1
    np.testing.assert_array_equal(K.reduce_lastdim("sum", over, -1, False, None, alloc_none),
                                  [np.inf, -np.inf])
    cancel = np.concatenate([rng.standard_normal(500), -rng.standard_normal(500)]).astype(F32)
    cancel = np.stack([cancel, cancel[::-1] * 1e20])
    assert_sum_close(K.reduce_lastdim("sum", cancel, -1, False, None, alloc_none), cancel, -1)
    tiny = np.full((1, 300), 1e-45, F32)  # subnormals add exactly
    assert K.reduce_lastdim("sum", tiny, -1, False, None, alloc_none)[0] == tiny[0, 0] * 300


def test_reductions_of_special_values():
    a = np.float32([[np.nan, 1, 2], [np.inf, 1, 2], [-np.inf, -np.inf, -np.inf],
                    [np.inf, -np.inf, 0], [-0.0, -0.0, -0.0], [3e38, 3e38, 0],
                    [1e-45, 1e-45, 0], [5, np.nan, np.inf]])
    for op, fn in (("sum", np.sum), ("mean", np.mean), ("amax", np.max)):
        with np.errstate(all="ignore"):
            want = fn(a, axis=-1)
        got = K.reduce_lastdim(op, a, -1, False, None, alloc_none)
        np.testing.assert_array_equal(got, want, err_msg=op)
        np.testing.assert_array_equal(np.signbit(got), np.signbit(want), err_msg=op)
    long = np.zeros((3, 100), F32)
    long[0, 77], long[1, 5], long[2, :] = np.nan, np.inf, -np.inf
    np.testing.assert_array_equal(K.reduce_lastdim("amax", long, 1, False, None, alloc_none),
                                  [np.nan, np.inf, -np.inf])
    # rows long enough for the lanes: the results no summation order changes
    rows = np.ones((6, 300), F32)
    rows[0, 77], rows[1, 299], rows[2, 5], rows[3, :] = np.nan, np.inf, -np.inf, -0.0
    rows[4, 3], rows[4, 250] = np.inf, -np.inf
    rows[5, 1::2] = -1.0
    with np.errstate(all="ignore"):
        want = np.sum(rows, axis=-1)
    got = K.reduce_lastdim("sum", rows, -1, False, None, alloc_none)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))  # -0.0 rows sum to +0.0


@pytest.mark.parametrize("shape", REDUCE_SHAPES)
def test_amax_equals_numpy(shape):
    a = sample(shape, F32, seed=len(shape))
    for dim in (-1, None):
        got = K.reduce_lastdim("amax", a, dim, True, None, alloc_none)
        np.testing.assert_array_equal(got, np.max(a, axis=-1 if dim == -1 else None,
                                                  keepdims=True))


def test_reduce_lastdim_writes_into_what_alloc_gives():
    a = sample((4, 6), F32)
    out = np.empty(4, F32)
    seen = []

    def alloc(shape, dtype, like):
        seen.append((shape, dtype, like))
        return out

    assert K.reduce_lastdim("sum", a, -1, False, None, alloc) is out
    assert seen == [((4,), F32, a)]
    assert out.tobytes() == K.reduce_lastdim("sum", a, -1, False, None, alloc_none).tobytes()


@pytest.mark.parametrize(
    ("a", "dim", "dtype", "alloc"),
    [
        (sample((3, 4), F32).T, -1, None, alloc_none),  # not C-contiguous
        (sample((3, 4), F64), -1, None, alloc_none),  # float64: numpy
        (sample((3, 4), np.float16), -1, None, alloc_none),
        (np.arange(12).reshape(3, 4), -1, None, alloc_none),
        (np.zeros((0, 3), F32), -1, None, alloc_none),  # empty
        (np.zeros((3, 0), F32), None, None, alloc_none),
        (np.float32(1.0).reshape(()), None, None, alloc_none),  # 0-d
        (sample((3, 4), F32), 0, None, alloc_none),  # not the last dim
        (sample((3, 4), F32), [0], None, alloc_none),  # a list naming another dim
        (sample((3, 4), F32), (1, 1), None, alloc_none),  # a repeated dim: numpy raises
        (sample((3, 4), F32), (2,), None, alloc_none),  # out of range
        (sample((3, 4), F32), (1.0,), None, alloc_none),  # not an int
        (sample((3, 4), F32), True, None, alloc_none),  # a bool is no dim
        (sample((3, 4), F32), -1, F64, alloc_none),  # another result dtype
        (sample((3, 4), F32), -1, None, lambda s, d, like: np.empty(8, F32)[::2]),
    ],
    ids=["transposed", "float64", "float16", "int", "empty", "empty-rows", "0-d", "dim0",
         "list0", "repeated", "range", "float-dim", "bool", "dtype", "strided-out"],
)
def test_reduce_lastdim_declines_what_it_does_not_serve(a, dim, dtype, alloc):
    for op in ("sum", "mean", "amax"):
        assert K.reduce_lastdim(op, a, dim, False, dtype, alloc) is None


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("dtype", [F32, F64], ids=["f32", "f64"])
def test_last_dim_softmax_is_softmax_lastdim(log, dtype):
    """The front's raw softmax form: the bytes of :func:`softmax_lastdim`, into a given
    output too; what the loop does not serve goes to the fallback with its ``out``."""
    f = K.LastDimSoftmax(log, lambda a, out: ("fallback", a, out))
    a = sample((5, 33), dtype)
    want = K.softmax_lastdim(a, log, alloc_none)
    assert f(a, None).tobytes() == want.tobytes()
    out = np.empty_like(a)
    assert f(a, out) is out and out.tobytes() == want.tobytes()
    for b, o in [(a.T, None), (a.astype(np.float16), None), (np.zeros((0, 3), dtype), None),
                 (a, np.empty((5, 34), dtype)[:, :33]), (a, np.empty(a.shape, np.float16))]:
        got = f(b, o)
        assert got[0] == "fallback" and got[1] is b and got[2] is o


@pytest.mark.parametrize("op", ["sum", "amax"])
@pytest.mark.parametrize("shape", [(3, 7), (2, 3, 1000), (70_003,)])
def test_last_dim_reduce_is_reduce_lastdim(op, shape):
    """The compiled front's raw reduce form (``ufunc.reduce``'s call) gives the bytes of
    :func:`reduce_lastdim` (what the local kernels give) over the last or every axis, into
    a given output too; what it does not serve goes to the ufunc unchanged."""
    ufunc = {"sum": np.add, "amax": np.maximum}[op]
    r = K.LastDimReduce(op, ufunc.reduce)
    a = sample(shape, F32, seed=len(shape), special=op == "amax")
    served = [(a.ndim - 1,), tuple(range(a.ndim))]
    others = [(0,)] if a.ndim > 1 else []
    for axes in served + others:
        for keepdims in (False, True):
            for dtype in (None, F32):
                want = (np.asarray(K.reduce_lastdim(op, a, axes, keepdims, dtype, alloc_none))
                        if axes in served else np.asarray(ufunc.reduce(a, axes, dtype, None,
                                                                       keepdims)))
                got = np.asarray(r(a, axes, dtype, None, keepdims))
                assert got.shape == want.shape and got.tobytes() == want.tobytes(), axes
            out = np.empty(want.shape, F32)
            assert r(a, axes, None, out, keepdims) is out
            assert out.tobytes() == want.tobytes()
    spy = K.LastDimReduce(op, lambda *args: "numpy")
    last = served[0]
    rows = a.size // a.shape[-1]
    strided = np.empty(2 * rows, F32)[::2]  # one element: contiguous all the same
    for args in [(a[..., ::2], last, None, None, False),  # not C-contiguous
                 (a.astype(F64), last, None, None, False),  # float64
                 (a, last, F64, None, False),  # another result dtype
                 (a, last, None, np.empty(rows + 1, F32), False),  # an out of another size
                 *([(a, last, None, strided, False)] if rows > 1 else []),  # a strided out
                 (np.zeros((0, 3), F32), (1,), None, None, False)]:  # empty
        assert spy(*args) == "numpy", args[1:]
    with pytest.raises(ValueError, match="op must be"):
        K.LastDimReduce("prod", np.multiply.reduce)


@pytest.mark.parametrize("dtype", [F32, F64, np.dtype(np.int16), np.dtype(np.int8),
                                   np.dtype(np.bool_)], ids=str)
@pytest.mark.parametrize("shape", [(64, 64), (130, 67), (3, 100, 70), (2, 2, 9, 200), (5, 1),
                                   (8, 8), (7, 9), (2, 33)])
def test_copy_into_transposes_by_tiles_and_equals_numpy(dtype, shape):
    """``copy_into`` of an ``x.mT`` layout (the tiled transpose, edges included) and of
    other layouts (numpy's copy) gives the C-order copy."""
    c = (np.random.default_rng(7).standard_normal(shape) * 50).astype(dtype)
    for a in (np.swapaxes(c, -1, -2), c[..., ::2], c, np.swapaxes(c, 0, -1)):
        out = np.empty(a.shape, dtype)
        assert K.copy_into(out, a) is out
        np.testing.assert_array_equal(out, a)
    with pytest.raises(ValueError, match="out must be"):
        K.copy_into(np.empty(c.shape, dtype)[::-1], c)


@pytest.mark.parametrize(("dtype", "shape"), [
    (F32, (1100, 520)),  # 2.2 MB: non-temporal stores (16-byte aligned rows)
    (F32, (1031, 517)),  # rows of 2068 bytes: not 16-byte aligned, plain stores, edges
    (F64, (3, 300, 330)),  # a batch of 2.4 MB
    (np.dtype(np.int16), (1090, 1000)),
    (np.dtype(np.uint8), (2100, 1030)),
], ids=str)
def test_copy_into_streams_large_transposes_and_equals_numpy(dtype, shape):
    """The tiled transpose of outputs of 2 MiB and more (non-temporal stores where the
    output's rows are 16-byte aligned), into aligned and misaligned outputs, bit for bit
    (NaN payloads, -0.0 and infinities of floating dtypes included)."""
    rng = np.random.default_rng(11)
    c = rng.integers(0, 256, (*shape[:-2], shape[-1], shape[-2]) if len(shape) > 2 else
                     (shape[1], shape[0]), dtype=np.uint8)  # fmt: skip
    c = np.frombuffer(rng.bytes(c.size * dtype.itemsize), dtype).reshape(c.shape)
    a = np.swapaxes(c, -1, -2)
    assert a.shape == shape and a.nbytes >= 2 << 20
    want = np.ascontiguousarray(a).view(np.uint8)
    out = K.copy_into(np.empty(shape, dtype), a)
    np.testing.assert_array_equal(out.view(np.uint8), want)
    # an output whose start is 4 bytes past a 16-byte boundary: plain stores
    raw = np.empty(a.nbytes + 64, np.uint8)
    off = (-raw.ctypes.data) % 16 + 4
    shifted = raw[off:off + a.nbytes].view(dtype).reshape(shape) if dtype.itemsize <= 4 else (
        raw[off + 4:off + 4 + a.nbytes].view(dtype).reshape(shape))
    assert shifted.ctypes.data % 16 != 0
    np.testing.assert_array_equal(K.copy_into(shifted, a).view(np.uint8), want)


# ------------------------------------------------------------------------------ layer_norm
def layer_norm64(a, k, w=None, b=None, eps=1e-5):
    x = a.astype(F64)
    axes = tuple(range(a.ndim - k, a.ndim))
    c = x - x.mean(axes, keepdims=True)
    r = c / np.sqrt((c * c).mean(axes, keepdims=True) + eps)
    return r * (1 if w is None else w) + (0 if b is None else b)


@pytest.mark.parametrize("affine", ["none", "weight", "bias", "both"])
@pytest.mark.parametrize(("shape", "ns"), [((5, 7), 7), ((3, 4, 50), (4, 50)),
                                           ((6, 1000), [1000]), ((2, 1), (1,))])
def test_layer_norm_float32_matches_float64(shape, ns, affine):
    a = sample(shape, F32, seed=5, special=False) * 3 + 1
    k = 1 if isinstance(ns, int) else len(ns)
    pshape = shape[len(shape) - k:]
    w = sample(pshape, F32, seed=6, special=False) if affine in ("weight", "both") else None
    b = sample(pshape, F32, seed=7, special=False) if affine in ("bias", "both") else None
    got = K.layer_norm(a, ns, w, b, 1e-5, alloc_none)
    assert got.dtype == F32 and got.shape == a.shape
    np.testing.assert_allclose(got, layer_norm64(a, k, w, b), rtol=2e-5, atol=2e-6)


def test_layer_norm_special_rows_follow_the_twin():
    a = np.float32([[1, np.nan, 2, 3], [np.inf, 1, 2, 3], [-np.inf] * 4, [2, 2, 2, 2],
                    [1e-40, 0, -1e-40, 0]])
    got = K.layer_norm(a, 4, None, None, 1e-5, alloc_none)
    with np.errstate(all="ignore"):  # the twin's float32 steps
        c = a - a.mean(-1, keepdims=True)
        want = c / np.sqrt((c * c).mean(-1, keepdims=True) + np.float32(1e-5))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    assert not got[3].any()  # a constant row normalises to zeros


def test_layer_norm_declines_what_it_does_not_serve():
    a = sample((3, 4), F32)
    w = np.ones(4, F32)
    assert K.layer_norm(a, 3, None, None, 1e-5, alloc_none) is None  # shape mismatch
    assert K.layer_norm(a, (3, 4, 1), None, None, 1e-5, alloc_none) is None
    assert K.layer_norm(a, (), None, None, 1e-5, alloc_none) is None
    assert K.layer_norm(a, 4.0, None, None, 1e-5, alloc_none) is None
    assert K.layer_norm(a.T.copy().T, 4, None, None, 1e-5, alloc_none) is None
    assert K.layer_norm(a.astype(F64), 4, None, None, 1e-5, alloc_none) is None
    assert K.layer_norm(np.zeros((0, 4), F32), 4, None, None, 1e-5, alloc_none) is None
    assert K.layer_norm(a, 4, w.astype(F64), None, 1e-5, alloc_none) is None
    assert K.layer_norm(a, 4, None, np.ones(8, F32)[::2], 1e-5, alloc_none) is None
    assert K.layer_norm(a, 4, np.ones(5, F32), None, 1e-5, alloc_none) is None
    out = np.empty_like(a)
    assert K.layer_norm(a, 4, w, None, 1e-5, lambda s, d, like: out) is out


def test_large_reductions_and_layer_norm_release_the_gil_and_agree():
    a = sample((300, 300), F32, special=False)  # above the no-GIL threshold
    assert_sum_close(K.reduce_lastdim("sum", a, None, False, None, alloc_none), a, None)
    np.testing.assert_array_equal(K.reduce_lastdim("amax", a, -1, False, None, alloc_none),
                                  a.max(-1))
    np.testing.assert_allclose(K.layer_norm(a, 300, None, None, 1e-5, alloc_none),
                               layer_norm64(a, 1), rtol=2e-5, atol=2e-6)


# ------------------------------------------------------------ the local ops, in both modes
# These run with and without the compiled kernels (DTENSOR_FASTPATH=0 runs the numpy twins,
# except for the float32 row sums and means, which run the compiled loop in both modes):
# the sums must be the compiled loop's bytes in both modes, amax numpy's, the others within
# float32 tolerances.


@pytest.mark.parametrize("shape", [(8, 8), (4, 8), (33, 130), (256, 512)])
def test_local_reductions_give_the_compiled_sums_in_both_modes(shape):
    a = sample(shape, F32, seed=11, special=False)
    x = dt.from_numpy(a)

    def loop(op, dim, keepdim=False):
        return K.reduce_lastdim(op, a, dim, keepdim, None if op == "sum" else F32, alloc_none)

    assert _math_reduce._SUMS is K  # whatever DTENSOR_FASTPATH says
    for got, want in [
        (dt.sum(x, -1), loop("sum", -1)), (dt.sum(x, 1, True), loop("sum", 1, True)),
        (dt.sum(x, (1,)), loop("sum", -1)), (dt.sum(x, [0, 1]), loop("sum", None)),
        (dt.sum(x), loop("sum", None)), (dt.mean(x, -1), loop("mean", -1)),
        (dt.mean(x), loop("mean", None)), (dt.mean(x, (0, 1), True), loop("mean", None, True)),
        (dt.amax(x, -1), np.max(a, -1)), (dt.amax(x), np.max(a)),
        (x.T.sum(-1), np.sum(a.T, -1)),  # a transposed view: the numpy path
        (dt.sum(x, 0), np.sum(a, 0)),  # not the last dim: numpy
    ]:
        w = np.asarray(want)
        assert got.shape == w.shape and got.numpy().tobytes() == w.tobytes()
    for d in (-1, None):  # within rounding of numpy's pairwise sums
        assert_sum_close(dt.sum(x, d).numpy(), a, d)
        assert_sum_close(dt.mean(x, d).numpy(), a, d, a.shape[-1] if d == -1 else a.size)


@pytest.mark.mode_independent
@pytest.mark.parametrize("dtype", [np.dtype(np.float16), F64], ids=["f16", "f64"])
def test_local_sums_of_other_dtypes_and_layouts_are_numpys(dtype):
    """float16/float64, non-contiguous and empty inputs: numpy's sums, to the bit."""
    a = sample((9, 70), dtype, seed=13, special=False)
    x = dt.from_numpy(a)
    for got, want in [(dt.sum(x, -1), np.sum(a, -1)), (dt.sum(x), np.sum(a)),
                      (dt.mean(x, -1), np.mean(a, -1, dtype=F32 if dtype != F64 else F64)
                       .astype(dtype)),
                      (dt.sum(x[:, ::3], -1), np.sum(a[:, ::3], -1))]:
        w = np.asarray(want)
        assert got.shape == w.shape and got.numpy().tobytes() == w.tobytes()
    e = dt.from_numpy(np.zeros((0, 5), F32))
    assert dt.sum(e, -1).shape == (0,) and dt.sum(e).item() == 0


@pytest.mark.mode_independent
def test_numpy_sums_without_the_extension_agree_within_rounding(monkeypatch):
    """What an install without the extension runs (numpy's pairwise sums) against the
    compiled loop: equal within float32 rounding."""
    a = sample((40, 1000), F32, seed=14, special=False)
    x = dt.from_numpy(a)
    compiled = [dt.sum(x, -1).numpy(), dt.mean(x, -1).numpy(), dt.sum(x).numpy()]
    monkeypatch.setattr(_math_reduce, "_SUMS", None)
    twins = [dt.sum(x, -1).numpy(), dt.mean(x, -1).numpy(), dt.sum(x).numpy()]
    np.testing.assert_array_equal(twins[0], np.sum(a, -1))
    for c, t in zip(compiled, twins):
        np.testing.assert_allclose(c, t, rtol=2e-6, atol=float(50 * U32 * np.abs(a).sum()))


@pytest.mark.parametrize("shape", [(8, 8), (16, 33), (128, 256)])
def test_local_softmax_layer_norm_gelu_in_both_modes(shape):
    a = sample(shape, F32, seed=12, special=False) * 4
    x = dt.from_numpy(a)
    w, b = dt.from_numpy(a[0] * 0 + 1.5), dt.from_numpy(a[1])
    np.testing.assert_allclose(dt.softmax(x, -1).numpy(), softmax64(a, False), rtol=4e-6,
                               atol=1e-12)
    np.testing.assert_allclose(dt.log_softmax(x, 1).numpy(), softmax64(a, True), rtol=4e-6,
                               atol=1e-6)
    np.testing.assert_allclose(dt.softmax(x.T, -1).numpy(), softmax64(a.T, False), rtol=4e-6,
                               atol=1e-12)
    np.testing.assert_allclose(dt.layer_norm(x, (shape[1],), w, b).numpy(),
                               layer_norm64(a, 1, 1.5, a[1]), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(dt.gelu(x).numpy(), gelu_reference(a), rtol=1e-5, atol=2e-7)
    h = dt.from_numpy(a.astype(np.float16))  # float16: the numpy twins, in float32
    np.testing.assert_allclose(dt.softmax(h, -1).numpy(), softmax64(a.astype(np.float16),
                               False), rtol=2e-3, atol=1e-4)
    d = dt.from_numpy(a.astype(F64))  # float64: libm loops or numpy
    np.testing.assert_allclose(dt.layer_norm(d, (shape[1],)).numpy(), layer_norm64(a, 1),
                               rtol=1e-10, atol=1e-12)
