"""Local math kernels (dtensor/_math*.py) against numpy on the same data.

Every op is checked for values and for PyTorch's result dtype, on contiguous and
non-contiguous inputs (transposed, stepped slices, expanded), with broadcasting, python
scalars on either side, dims None/int/tuple/negative, keepdim and empty tensors. Where
PyTorch and numpy differ (type promotion, integer true division, max with a dim), the
expected values are PyTorch's.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
import warnings
import zlib

import numpy as np
import pytest
from helpers.jobs import PKG_ROOT

import dtensor as dt
from dtensor.errors import DTypeError, ShardingError, ViewError
from dtensor.local import allocator as _allocator

F16, F32, F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)
I8, I32, I64, U8 = np.dtype(np.int8), np.dtype(np.int32), np.dtype(np.int64), np.dtype(np.uint8)
B = np.dtype(np.bool_)
C64 = np.dtype(np.complex64)

#: The generator ``data`` draws from: a fresh one per test (see ``_rng``).
RNG: np.random.Generator | None = None

# dtensor's kernels never emit numpy's floating-point RuntimeWarnings (checked by
# test_kernels_never_warn_on_floating_point_errors and test_no_floating_point_warnings); the
# numpy references computed here do, on NaN and inf samples: ignored.
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")


@pytest.fixture(autouse=True)
def _rng(monkeypatch, request):
    """Each test draws its data from its own generator, seeded from its name (with its
    parameters), so what a test sees does not depend on which tests ran before it."""
    seed = zlib.crc32(request.node.name.encode())
    monkeypatch.setitem(globals(), "RNG", np.random.default_rng(seed))


def T(a) -> dt.Tensor:
    return dt.from_numpy(np.asarray(a))


def N(t) -> np.ndarray:
    return np.asarray(t.numpy())


def data(shape, dtype, *, positive=False, nonzero=False):
    dtype = np.dtype(dtype)
    if dtype == B:
        return RNG.random(shape) < 0.5
    if dtype.kind in "iu":
        lo = 1 if positive else (0 if dtype.kind == "u" else -5)
        a = RNG.integers(lo, 6, size=shape).astype(dtype)
        if nonzero:
            a[a == 0] = 3
        return a
    a = RNG.standard_normal(shape)
    if positive:
        a = np.abs(a) + 0.1
    return a.astype(dtype)


#: The element strides of each layout of ``layouts``.
LAYOUT_STRIDES = {"contiguous": (4, 1), "transposed": (1, 3), "stepped": (18, 2),
                  "expanded": (0, 1)}  # fmt: skip


def layouts(make):
    """(name, tensor, equal ndarray) of shape (3, 4) in four memory layouts; each tensor
    is checked to have its layout's strides (a view op that copied would not)."""
    base = make((3, 4))
    big_t = make((4, 3))
    stepped = make((6, 9))
    row = make((1, 4))
    out = [
        ("contiguous", T(base), base),
        ("transposed", T(big_t).t(), big_t.T),
        ("stepped", T(stepped)[::2, 1::2][:, :4], stepped[::2, 1::2][:, :4]),
        ("expanded", T(row).expand(3, 4), np.broadcast_to(row, (3, 4))),
    ]
    for name, t, _ in out:
        assert t.stride() == LAYOUT_STRIDES[name], (name, t.stride())
    return out


def tol(dtype):
    return {F16: 2e-3, F32: 2e-6, F64: 1e-12}.get(np.dtype(dtype), 0)


def check(t, expected, dtype=None, rtol=None):
    """``t`` equals ``expected`` (values and dtype; NaN == NaN)."""
    expected = np.asarray(expected)
    dtype = np.dtype(dtype) if dtype is not None else expected.dtype
    assert isinstance(t, dt.Tensor)
    assert t.dtype == dtype, (t.dtype, dtype)
    assert tuple(t.shape) == expected.shape, (tuple(t.shape), expected.shape)
    got = N(t)
    if dtype.kind in "fc":
        r = tol(dtype) if rtol is None else rtol
        np.testing.assert_allclose(got, expected.astype(dtype), rtol=r, atol=r, equal_nan=True)
    else:
        np.testing.assert_array_equal(got, expected)


# ------------------------------------------------------------------------------ unary

def _erf_ref(x):
    return np.vectorize(math.erf, otypes=[np.float64])(x)


def _float_of(dtype):
    return dtype if dtype.kind == "f" else F32


# name -> (reference on float64 values, dtype rule, input domain)
UNARY = {
    "neg": (np.negative, "same", None),
    "abs": (np.abs, "same", None),
    "exp": (np.exp, "float", None),
    "expm1": (np.expm1, "float", None),
    "log": (np.log, "float", "positive"),
    "log1p": (np.log1p, "float", "positive"),
    "log2": (np.log2, "float", "positive"),
    "sqrt": (np.sqrt, "float", "positive"),
    "rsqrt": (lambda x: 1 / np.sqrt(x), "float", "positive"),
    "sin": (np.sin, "float", None),
    "cos": (np.cos, "float", None),
    "tan": (np.tan, "float", None),
    "tanh": (np.tanh, "float", None),
    "sigmoid": (lambda x: 1 / (1 + np.exp(-x)), "float", None),
    "erf": (_erf_ref, "float", None),
    "reciprocal": (lambda x: 1 / x, "float", "nonzero"),
    "relu": (lambda x: np.maximum(x, 0), "same", None),
    "sign": (np.sign, "same", None),
    "floor": (np.floor, "same", None),
    "ceil": (np.ceil, "same", None),
    "round": (np.rint, "same", None),
    "trunc": (np.trunc, "same", None),
    "square": (np.square, "same", None),
    "logical_not": (np.logical_not, "bool", None),
    "isnan": (np.isnan, "bool", None),
    "isinf": (np.isinf, "bool", None),
    "isfinite": (np.isfinite, "bool", None),
}


def _unary_expected(name, x):
    ref, rule, _ = UNARY[name]
    rt = {"same": x.dtype, "float": _float_of(x.dtype), "bool": B}[rule]
    return ref(x.astype(np.float64)).astype(rt), rt


@pytest.mark.parametrize("name", sorted(UNARY))
@pytest.mark.parametrize("dtype", [F32, F64, I64])
def test_unary_matches_numpy(name, dtype):
    domain = UNARY[name][2]
    def make(shape):
        return data(shape, dtype, positive=domain == "positive", nonzero=domain == "nonzero")

    for _, t, x in layouts(make):
        exp, rt = _unary_expected(name, x)
        check(getattr(dt, name)(t), exp, rt)
        check(getattr(t, name)(), exp, rt)


@pytest.mark.parametrize("name", ["sign", "floor", "ceil", "round", "trunc",
                                  "logical_not", "isnan", "isfinite", "bitwise_not"])
def test_unary_bool_inputs(name):
    x = data((3, 4), B)
    r = getattr(dt, name)(T(x))
    if name in ("isnan",):
        check(r, np.zeros_like(x))
    elif name == "isfinite":
        check(r, np.ones_like(x))
    elif name in ("logical_not", "bitwise_not"):
        check(r, ~x)
    else:
        check(r, x)


def test_unary_float16_and_empty():
    x = data((5,), F16)
    check(dt.exp(T(x)), np.exp(x.astype(F64)).astype(F16), F16)
    check(dt.erf(T(x)), _erf_ref(x.astype(F64)).astype(F16), F16)
    e = T(np.zeros((0, 3), F32))
    check(dt.exp(e), np.zeros((0, 3), F32))
    check(dt.sigmoid(T(np.float32(0.5))), np.float32(1 / (1 + math.exp(-0.5))))


def test_unary_dtype_errors():
    with pytest.raises(DTypeError, match="neg.*Bool"):
        dt.neg(T(data((2,), B)))
    with pytest.raises(DTypeError, match="neg"):
        -T(data((2,), B))
    with pytest.raises(DTypeError, match="abs"):
        abs(T(data((2,), B)))
    with pytest.raises(DTypeError, match="bitwise_not.*Float"):
        ~T(data((2,), F32))
    with pytest.raises(DTypeError, match="silu"):
        dt.silu(T(data((2,), I64)))
    with pytest.raises(DTypeError):
        dt.exp(2.0)


def test_no_floating_point_warnings():
    # PyTorch never warns about inf/nan results; dtensor's kernels run with numpy's
    # floating-point errors ignored (checked in a fresh interpreter, every warning an error).
    code = (
        "import numpy as np, dtensor as dt\n"
        "x = dt.tensor([0.0, 1.0, -1.0, 1e30])\n"
        "for r in (x / 0, dt.log(x), x * 1e30, dt.exp(x * 100), dt.erf(x), dt.softplus(x),\n"
        "          dt.sigmoid(x * 1e3), dt.log_softmax(x, 0), dt.logsumexp(x * 0 - np.inf, 0),\n"
        "          dt.mean(dt.zeros(0)), dt.var(dt.ones(1)), x ** -1.0):\n"
        "    r.numpy()\n"
    )
    done = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": PKG_ROOT},
                          check=False)
    assert done.returncode == 0, done.stderr


def _fp_error_cases(make, shape=(8, 8)):
    """Calls whose numpy computation raises a floating-point error (overflow, division by
    zero, invalid), on tensors made by ``make`` from an array (mostly of ``shape``, square
    or not): name -> call."""
    h = make(np.full((8,), 60000, np.float16))
    big = make(np.full(shape, 100.0, np.float32))
    huge = make(np.full(shape, 3e38, np.float32))
    one, zero = make(np.ones(shape, np.float32)), make(np.zeros(shape, np.float32))
    neg = make(-np.ones(shape, np.float32))
    return {
        "float16 sum": lambda: h.sum(),
        "float16 sum dim": lambda: dt.sum(h, 0),
        "exp": lambda: big.exp(),
        "dt.exp": lambda: dt.exp(big),
        "mul": lambda: huge * huge,
        "mul scalar": lambda: huge * 10.0,
        "dt.mul": lambda: dt.mul(huge, huge),
        "x / 0": lambda: one / 0,
        "x / zeros": lambda: one / zero,
        "0 / 0": lambda: zero / zero,
        "log(-1)": lambda: neg.log(),
        "dt.log(-1)": lambda: dt.log(neg),
        "sqrt(-1)": lambda: neg.sqrt(),
        "mean": lambda: huge.mean(),
        "in place": lambda: huge.clone().mul_(huge),
        "matmul": lambda: huge @ huge.T,
        "softmax": lambda: dt.softmax(neg * np.inf, 0),
    }


@pytest.mark.parametrize("case", sorted(_fp_error_cases(T)))
def test_kernels_never_warn_on_floating_point_errors(case):
    # PyTorch gives inf/nan silently; numpy's RuntimeWarnings must not reach the caller,
    # even when it turns every warning into an error (after dtensor was imported)
    fn = _fp_error_cases(T)[case]
    before = np.geterr()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):  # the first call and a repeated one
            r = fn()
        assert not np.isfinite(r.numpy()).all(), case
        # the caller's own numpy code keeps its error state and its warnings
        assert np.geterr() == before
        with pytest.raises(RuntimeWarning, match="divide by zero"):
            np.ones(2) / np.zeros(2)


def _cast_cases():
    """Casts through Tensor's own methods and the factories, each overflowing (or casting
    NaN to an integer): name -> (call, the source values, the target dtype)."""
    big = np.array([1e10, 3.0], np.float32)
    nan = np.array([np.nan, 1.0], np.float32)
    f16 = np.dtype(np.float16)

    def setitem():
        t = dt.zeros(2, dtype=f16)
        t[:] = T(big)
        return t

    return {
        "to(float16)": (lambda: T(big).to(f16), big, f16),
        "half": (lambda: T(big).half(), big, f16),
        "type_as": (lambda: T(big).type_as(dt.zeros(1, dtype=f16)), big, f16),
        "copy_": (lambda: dt.zeros(2, dtype=f16).copy_(T(big)), big, f16),
        "setitem": (setitem, big, f16),
        "fill_": (lambda: dt.zeros(2, dtype=f16).fill_(1e10), np.full(2, 1e10), f16),
        "full": (lambda: dt.full((2,), 1e10, dtype=f16), np.full(2, 1e10), f16),
        "tensor": (lambda: dt.tensor([1e10, 3.0], dtype=f16), big, f16),
        "nan to int32": (lambda: T(nan).to(np.int32), nan, np.dtype(np.int32)),
    }


@pytest.mark.parametrize("case", sorted(_cast_cases()))
def test_casts_never_warn(case):
    # an overflowing cast gives inf (or wraps) silently, as in PyTorch, with numpy's values
    fn, src, dtype = _cast_cases()[case]
    with np.errstate(all="ignore"):
        want = src.astype(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = fn().numpy()
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, want)


def test_kernels_never_warn_in_another_thread():
    # every thread runs dtensor's kernels quietly; numpy lets other threads run while it
    # computes on 1000 elements, so they find the shared quiet contexts entered and use
    # contexts of their own
    errors = []

    def work():
        try:
            for _ in range(50):
                for fn in _fp_error_cases(T, (25, 40)).values():
                    fn()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the filters are the process's: every thread's
        threads = [threading.Thread(target=work) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors


def test_erf_accuracy():
    special = [0.0, -0.0, 1e-300, 1e-8, 0.5, 0.99999, 1.0, 1.00001, 2.0, 3.5, 5.9, 6.0, 6.1,
               10.0, 30.0, np.inf]
    x64 = np.concatenate([np.linspace(-7, 7, 20001), special, -np.array(special)])
    ref = _erf_ref(x64)
    got = N(dt.erf(T(x64)))
    rel = np.abs(got - ref) / np.maximum(np.abs(ref), 1e-300)
    assert rel.max() <= 1e-13
    assert got[x64 == np.inf].tolist() == [1.0] and got[x64 == -np.inf].tolist() == [-1.0]
    assert np.isnan(N(dt.erf(T(np.array([np.nan]))))[0])
    x32 = x64.astype(F32)
    got32 = N(dt.erf(T(x32)))
    assert got32.dtype == F32
    ref32 = _erf_ref(x32.astype(F64))
    assert (np.abs(got32 - ref32) / np.maximum(np.abs(ref32), 1e-30)).max() <= 1e-6


def test_activations():
    x = np.concatenate([data((50,), F64), [-800.0, -30.0, 0.0, 30.0, 800.0]])
    t = T(x)
    gelu = 0.5 * x * (1 + _erf_ref(x / math.sqrt(2)))
    check(dt.gelu(t), gelu)
    inner = math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)
    check(dt.gelu(t, approximate="tanh"), 0.5 * x * (1 + np.tanh(inner)))
    sig = np.where(x >= 0, 1 / (1 + np.exp(-np.abs(x))), np.exp(-np.abs(x)) /
                   (1 + np.exp(-np.abs(x))))
    check(dt.sigmoid(t), sig)
    check(dt.silu(t), x * sig)
    sp = np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))
    check(dt.softplus(t), sp)
    check(dt.softplus(t, beta=2.0, threshold=5.0),
          np.where(2 * x > 5, x, np.log1p(np.exp(np.minimum(2 * x, 5))) / 2))
    check(dt.leaky_relu(t, 0.2), np.where(x > 0, x, 0.2 * x))
    check(dt.relu(T(np.array([-1, 0, 3], I8))), np.array([0, 0, 3], I8))
    with pytest.raises(ValueError, match="approximate"):
        dt.gelu(t, approximate="fast")
    check(dt.round(T(np.array([1.25, 2.5, -0.5])), decimals=1), np.round([1.25, 2.5, -0.5], 1))
    check(dt.round(T(np.array([0.5, 1.5, 2.5]))), np.array([0.0, 2.0, 2.0]))


# ----------------------------------------------------------------------------- binary

BINARY = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "div": np.true_divide,
    "floor_divide": np.floor_divide,
    "remainder": np.remainder,
    "fmod": np.fmod,
    "maximum": np.maximum,
    "minimum": np.minimum,
    "atan2": np.arctan2,
    "eq": np.equal,
    "ne": np.not_equal,
    "lt": np.less,
    "le": np.less_equal,
    "gt": np.greater,
    "ge": np.greater_equal,
    "logical_and": np.logical_and,
    "logical_or": np.logical_or,
    "logical_xor": np.logical_xor,
}
FLOAT_RESULT = {"div", "atan2"}
BOOL_RESULT = {"eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_xor"}


def _binary_expected(name, x, y, rt):
    """numpy on values computed in ``rt`` (PyTorch computes in the result dtype)."""
    ct = rt if name not in BOOL_RESULT or name.startswith("logical") else None
    if ct is None:
        ct = np.result_type(x, y) if x.dtype != y.dtype else x.dtype
    xx = x.astype(ct) if ct != B or x.dtype == B else x
    yy = y.astype(ct) if ct != B or y.dtype == B else y
    return BINARY[name](xx, yy).astype(B if name in BOOL_RESULT else rt)


@pytest.mark.parametrize("name", sorted(BINARY))
@pytest.mark.parametrize("dtype", [F32, F64, I64])
def test_binary_same_dtype_layouts(name, dtype):
    for (_, t, x), (_, u, y) in zip(layouts(lambda s: data(s, dtype)),
                                    layouts(lambda s: data(s, dtype, nonzero=True))):
        rt = B if name in BOOL_RESULT else (_float_of(dtype) if name in FLOAT_RESULT else dtype)
        exp = _binary_expected(name, x, y, rt)
        check(getattr(dt, name)(t, u), exp, rt)
        check(getattr(t, name)(u), exp, rt)


@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary_broadcast_and_scalars(name):
    x = data((2, 3, 4), F32)
    y = data((3, 1), F32, nonzero=True)
    rt = B if name in BOOL_RESULT else F32
    check(getattr(dt, name)(T(x), T(y)), _binary_expected(name, x, y, rt), rt)
    check(getattr(dt, name)(T(y), T(x)), _binary_expected(name, y, x, rt), rt)
    s = 1.5
    sx = np.full((), s, F32)
    check(getattr(dt, name)(T(x), s), _binary_expected(name, x, sx, rt), rt)
    check(getattr(dt, name)(s, T(x)), _binary_expected(name, sx, x, rt), rt)


def test_binary_shape_errors():
    with pytest.raises(ShardingError, match=r"add: shapes \(2, 3\) and \(4,\) do not broadcast"):
        dt.add(T(data((2, 3), F32)), T(data((4,), F32)))
    with pytest.raises(ShardingError):
        T(data((2, 3), F32)) * T(data((3, 2), F32))
    with pytest.raises(ValueError):
        dt.lt(T(data((2, 3), F32)), T(data((2, 2), F32)))


# (a, b) -> PyTorch's result dtype. Arrays are dimensioned unless given as ("0d", dtype);
# python scalars are given as values.
PROMOTION = [
    (F32, 2.5, F32),
    (F16, 2.5, F16),
    (I64, 2.5, F32),
    (I32, 5, I32),
    (U8, 5, U8),
    (I8, True, I8),
    (B, True, B),
    (B, 5, I64),
    (B, 2.5, F32),
    (F64, 2, F64),
    (I32, I64, I64),
    (U8, I8, np.dtype(np.int16)),
    (I64, F16, F16),
    (I32, F32, F32),
    (F16, F32, F32),
    (B, I32, I32),
    (B, F16, F16),
    (F32, ("0d", F64), F32),
    (I64, ("0d", F64), F64),
    (I32, ("0d", I64), I32),
    (B, ("0d", I64), I64),
    (("0d", F64), ("0d", F32), F64),
    (("0d", I64), 2.5, F32),
    (F32, 1j, C64),
    (I64, C64, C64),
]


def _operand(spec):
    if isinstance(spec, tuple):
        return T(data((), spec[1], nonzero=True))
    if isinstance(spec, np.dtype):
        return T(data((3,), spec, nonzero=True))
    return spec


@pytest.mark.parametrize("a,b,expected", PROMOTION)
def test_type_promotion_table(a, b, expected):
    x, y = _operand(a), _operand(b)
    assert dt.add(x, y).dtype == expected
    assert dt.add(y, x).dtype == expected
    assert dt.mul(x, y).dtype == expected
    if expected.kind != "b":
        assert dt.where(T(np.array(True)), x, y).dtype == expected
    xv = N(x) if isinstance(x, dt.Tensor) else np.asarray(x)
    yv = N(y) if isinstance(y, dt.Tensor) else np.asarray(y)
    check(dt.add(x, y), (xv.astype(expected) + yv.astype(expected)).astype(expected), expected)


def test_true_division_and_default_dtype():
    a, b = T(np.array([7, -7, 6])), T(np.array([2, 2, 4]))
    check(a / b, np.array([3.5, -3.5, 1.5], F32))
    check(a // b, np.array([3, -4, 1]))
    check(dt.div(a, b, rounding_mode="trunc"), np.array([3, -3, 1]))
    check(dt.div(a, b, rounding_mode="floor"), np.array([3, -4, 1]))
    check(dt.div(T(np.array([7.0, -7.0])), 2, rounding_mode="trunc"), np.array([3.0, -3.0]))
    check(1 / a, 1 / np.array([7, -7, 6], F32))
    with pytest.raises(ValueError, match="rounding_mode"):
        dt.div(a, b, rounding_mode="round")
    old = dt.get_default_dtype()
    try:
        dt.set_default_dtype(dt.float64)
        assert (a / b).dtype == F64
        assert (a + 2.5).dtype == F64
        assert (T(np.array([1.0], F32)) + 2.5).dtype == F32
    finally:
        dt.set_default_dtype(old)


def test_integer_division_by_zero_and_negative_powers():
    a = T(np.array([1, 2, 3]))
    for fn in (lambda: a // 0, lambda: a % T(np.array([1, 0, 1])), lambda: dt.fmod(a, 0),
               lambda: dt.div(a, 0, rounding_mode="trunc")):
        with pytest.raises(ZeroDivisionError):
            fn()
    with np.errstate(divide="ignore"):  # see test_no_floating_point_warnings
        check(T(np.array([1.0, -1.0])) / 0, np.array([np.inf, -np.inf]))
    with pytest.raises(DTypeError, match="negative integer powers"):
        a ** -1
    check(a ** 2, np.array([1, 4, 9]))
    check(a ** 0.5, np.sqrt(np.array([1, 2, 3], F32)))
    check(2 ** a, np.array([2, 4, 8]))
    check(T(np.array([2.0, 3.0], F32)) ** T(np.array([2, 3])), np.array([4.0, 27.0], F32))


def test_integer_scalar_wraps_like_pytorch():
    check(T(np.array([0, 1], U8)) - 1, np.array([255, 0], U8))
    check(T(np.array([100], I8)) + 1000, (np.array([100], I8) + np.int64(1000)).astype(I8))


def test_bitwise_and_logical():
    x, y = data((3, 4), I32), data((3, 4), I32)
    check(T(x) & T(y), x & y)
    check(T(x) | 3, x | 3)
    check(3 ^ T(x), 3 ^ x)
    check(~T(x), ~x)
    bx, by = data((5,), B), data((5,), B)
    check(T(bx) & T(by), bx & by)
    check(T(bx) ^ True, bx ^ True)
    with pytest.raises(DTypeError, match="bitwise_and.*Float"):
        T(data((2,), F32)) & T(data((2,), F32))
    z = data((3, 4), F32)
    check(dt.logical_and(T(x), T(z)), np.logical_and(x, z))
    check(dt.logical_xor(T(x), 0.0), x != 0)
    with pytest.raises(DTypeError, match="sub.*Bool"):
        T(bx) - T(by)


def test_complex_support():
    z = (data((3,), F32) + 1j * data((3,), F32)).astype(C64)
    check(T(z) * T(z) + 1.0, z * z + 1)
    check(T(z) == T(z), np.ones(3, bool))
    check(dt.exp(T(z)), np.exp(z), rtol=1e-5)
    for op in (dt.lt, dt.maximum, dt.floor_divide, dt.remainder):
        with pytest.raises(DTypeError, match="ComplexFloat"):
            op(T(z), T(z))
    check(dt.sigmoid(T(z)), 1 / (1 + np.exp(-z)), rtol=1e-5)
    with pytest.raises(DTypeError, match="floor.*ComplexFloat"):
        dt.floor(T(z))


def test_add_sub_alpha():
    x, y = data((3,), F32), data((3,), F32)
    check(dt.add(T(x), T(y), alpha=2), x + 2 * y)
    check(dt.sub(T(x), T(y), alpha=0.5), x - np.float32(0.5) * y)
    check(dt.add(T(np.array([1, 2])), T(np.array([3, 4])), alpha=3), np.array([10, 14]))
    with pytest.raises(DTypeError, match="alpha must not be a floating"):
        dt.add(T(np.array([1, 2])), T(np.array([3, 4])), alpha=0.5)
    check(dt.add(T(x), 2, alpha=3), x + 6)


def test_operators_and_reflected():
    x, y = data((3, 4), F64), data((3, 4), F64, nonzero=True)
    t, u = T(x), T(y)
    cases = [
        (t + u, x + y), (t - u, x - y), (t * u, x * y), (t / u, x / y), (t // u, x // y),
        (t % u, x % y), (abs(t) ** u, np.abs(x) ** y), (2 + t, 2 + x), (2 - t, 2 - x),
        (2 * t, 2 * x), (2 / u, 2 / y), (2 // u, 2 // y), (2 % u, 2 % y), (2 ** t, 2 ** x),
        (-t, -x), (+t, x), (abs(t), np.abs(x)), (t == u, x == y), (t != u, x != y),
        (t < u, x < y), (t <= u, x <= y), (t > u, x > y), (t >= u, x >= y), (1 < t, 1 < x),
        (t @ u.t(), x @ y.T), (x + t, x + x),
    ]
    for got, exp in cases:
        check(got, exp)
    assert (+t) is t
    assert hash(t) == object.__hash__(t) and len({t, t, T(x)}) == 2  # identity hash
    assert (t == None) is False
    assert (t != "a") is True
    with pytest.raises(TypeError):
        t + "a"
    with pytest.raises(TypeError):
        t @ 2


# ---------------------------------------------------------------------------- ternary

def test_where():
    c = data((3, 4), B)
    x, y = data((3, 4), F32), data((4,), F64)
    check(dt.where(T(c), T(x), T(y)), np.where(c, x, y).astype(F64))
    check(dt.where(T(c), T(x), 0.0), np.where(c, x, 0).astype(F32))
    check(dt.where(T(c), 1, 0), np.where(c, 1, 0).astype(I64))
    check(T(x).where(T(c), -1.0), np.where(c, x, -1).astype(F32))
    check(dt.where(T(c[:1]), T(np.array([[1], [2], [3]])), 2.5),
          np.where(c[:1], [[1], [2], [3]], 2.5).astype(F32))
    with pytest.raises(DTypeError, match="boolean"):
        dt.where(T(x), T(x), T(x))


def test_clamp():
    x = data((3, 4), F32)
    check(dt.clamp(T(x), -0.5, 0.5), np.clip(x, -0.5, 0.5))
    check(dt.clamp(T(x), min=0.0), np.maximum(x, 0))
    check(T(x).clip(max=0.1), np.minimum(x, np.float32(0.1)))
    lo = data((4,), F32)
    check(dt.clamp(T(x), T(lo)), np.maximum(x, lo))
    check(dt.clamp(T(x), 1.0, -1.0), np.full_like(x, -1.0))
    check(dt.clamp(T(np.array([1, 5, 9])), 2, 6), np.array([2, 5, 6]))
    check(dt.clamp(T(np.array([1, 5, 9])), 2.5), np.array([2.5, 5, 9], F32))
    check(dt.clamp(T(np.array([np.nan, 1.0])), 0.0, 0.5), np.array([np.nan, 0.5]))
    with pytest.raises(TypeError):
        dt.clamp(T(x))


def test_lerp_addcmul_addcdiv():
    x, e = data((3, 4), F64), data((3, 4), F64)
    for w in (0.25, 0.75, 1.0):
        check(dt.lerp(T(x), T(e), w), x + w * (e - x))
    assert (N(dt.lerp(T(x), T(e), 1.0)) == e).all()
    w = data((4,), F64)
    check(dt.lerp(T(x), T(e), T(w)), x + w * (e - x))
    a, b = data((3, 1), F64), data((4,), F64, nonzero=True)
    check(dt.addcmul(T(x), T(a), T(b), value=0.5), x + 0.5 * a * b)
    check(dt.addcdiv(T(x), T(a), T(b), value=2), x + 2 * a / b)
    check(dt.addcmul(T(np.array([1, 2])), T(np.array([3, 4])), T(np.array([5, 6])), value=2),
          np.array([31, 50]))
    with pytest.raises(DTypeError):
        dt.addcdiv(T(np.array([1])), T(np.array([1])), T(np.array([1])))
    with pytest.raises(DTypeError):
        dt.lerp(T(np.array([1])), T(np.array([2])), 0.5)


# ------------------------------------------------------------------------- reductions

DIMS = [None, 0, -1, (0, 2), (-1, 1), ()]


def _axis(dim):
    return None if dim is None or dim == () else dim


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("keepdim", [False, True])
def test_sum_prod_mean(dim, keepdim):
    for dtype in (F32, F64, I64, I32, B):
        x = data((2, 3, 4), dtype)
        t = T(x)
        rt = I64 if dtype.kind in "biu" else dtype
        check(dt.sum(t, dim, keepdim), np.sum(x, _axis(dim), dtype=rt, keepdims=keepdim), rt,
              rtol=1e-5)
        check(t.prod(dim, keepdim), np.prod(x, _axis(dim), dtype=rt, keepdims=keepdim), rt,
              rtol=1e-5)
        if dtype.kind == "f":
            check(t.mean(dim, keepdim), np.mean(x, _axis(dim), keepdims=keepdim), dtype,
                  rtol=1e-5)
        else:
            with pytest.raises(DTypeError, match="mean"):
                t.mean(dim, keepdim)
            check(t.mean(dim, keepdim, dtype=dt.float64),
                  np.mean(x.astype(F64), _axis(dim), keepdims=keepdim))


def test_reductions_on_views_and_dtypes():
    for _, t, x in layouts(lambda s: data(s, F64)):
        check(t.sum(0), x.sum(0))
        check(t.sum(), x.sum())
        check(t.amax(1), x.max(1))
        check(t.var(1), x.var(1, ddof=1))
    x = data((4, 5), I32)
    check(dt.sum(T(x), dtype=dt.float64), x.sum(dtype=F64))
    h = data((1000,), F16)
    check(dt.sum(T(h)), h.astype(F32).sum().astype(F16), F16, rtol=1e-3)
    assert dt.sum(T(np.array([200, 100, 50], U8))).item() == 350
    assert dt.sum(T(np.array([200, 100, 50], U8))).dtype == I64


def test_empty_reductions():
    e = T(np.zeros((0, 3), F32))
    check(e.sum(), np.float32(0))
    check(e.sum(0), np.zeros(3, F32))
    check(e.prod(0), np.ones(3, F32))
    check(e.mean(), np.float32(np.nan))
    check(e.mean(1), np.zeros(0, F32))
    check(e.amax(1), np.zeros(0, F32))
    check(e.any(), np.bool_(False))
    check(e.all(), np.bool_(True))
    with pytest.raises(ShardingError):
        e.amax()
    with pytest.raises(ShardingError):
        e.max(0)
    with pytest.raises(ShardingError):
        e.argmax()
    check(dt.logsumexp(e, 0), np.full(3, -np.inf, F32))


def test_max_min_argmax():
    x = np.array([[1.0, 5.0, 5.0, 0.0], [2.0, 2.0, -1.0, -1.0], [0.0, 3.0, 1.0, 3.0]])
    t = T(x)
    check(t.max(), np.float64(5.0))
    check(dt.min(t), np.float64(-1.0))
    r = t.max(1)
    assert type(r).__name__ == "max" and r._fields == ("values", "indices")
    values, indices = r
    check(values, x.max(1))
    check(indices, np.array([1, 0, 1]))
    check(r.indices, np.array([1, 0, 1]))
    r = dt.min(t, dim=-1, keepdim=True)
    check(r.values, x.min(1, keepdims=True))
    check(r.indices, np.array([[3], [2], [0]]))
    check(dt.argmax(t), np.int64(1))
    check(dt.argmin(t, 0), np.array([2, 1, 1, 1]))
    check(dt.argmax(t, 1, keepdim=True), np.array([[1], [0], [1]]))
    check(dt.argmax(t, keepdim=True), np.array([[1]]))
    check(t.max(T(np.full((4,), 2.0))), np.maximum(x, 2.0))
    check(t.amax((0, 1)), np.float64(5.0))
    check(t.amin(0, keepdim=True), x.min(0, keepdims=True))
    n = T(np.array([1.0, np.nan, 3.0, np.nan]))
    check(n.max(), np.float64(np.nan))
    check(n.argmax(), np.int64(1))
    check(n.max(0).indices, np.int64(1))
    s = T(np.array(4.0))
    check(s.max(0).values, np.float64(4.0))
    check(s.argmax(0), np.int64(0))
    check(s.sum(0), np.float64(4.0))


@pytest.mark.parametrize("dim", [None, 0, (0, 1), -1])
def test_var_std(dim):
    x = data((4, 5, 3), F64)
    t = T(x)
    ax = _axis(dim)
    check(dt.var(t, dim), x.var(ax, ddof=1))
    check(dt.std(t, dim, keepdim=True), x.std(ax, ddof=1, keepdims=True))
    check(dt.var(t, dim, unbiased=False), x.var(ax))
    check(dt.var(t, dim, correction=2), x.var(ax, ddof=2))
    check(t.std(dim, correction=0), x.std(ax))
    check(t.var(False), x.var())
    with pytest.raises(DTypeError):
        dt.var(T(data((3,), I64)))
    with pytest.raises(ShardingError):
        dt.var(t, 0, unbiased=True, correction=1)
    check(dt.var(T(np.array([1.0]))), np.float64(np.nan))
    f32 = data((100,), F32)
    check(dt.std(T(f32)), np.std(f32.astype(F64), ddof=1).astype(F32), F32, rtol=1e-5)


def test_norm():
    x = data((3, 4), F64)
    t = T(x)
    check(dt.norm(t), np.sqrt((x**2).sum()))
    check(t.norm(2, 1), np.linalg.norm(x, axis=1))
    check(t.norm(1, 0, keepdim=True), np.abs(x).sum(0, keepdims=True))
    check(t.norm(math.inf, 1), np.abs(x).max(1))
    check(t.norm(-math.inf), np.abs(x).min())
    check(t.norm(0), np.float64(np.count_nonzero(x)))
    check(t.norm(3, (0, 1)), (np.abs(x) ** 3).sum() ** (1 / 3))
    check(dt.norm(T(x.astype(F32)), "fro", dim=(0, 1)), np.linalg.norm(x).astype(F32), F32,
          rtol=1e-5)
    c = (x + 1j * x).astype(np.complex128)
    check(dt.norm(T(c)), np.linalg.norm(c))
    with pytest.raises(DTypeError):
        dt.norm(T(data((3,), I64)))
    i = data((3,), I64)
    check(dt.norm(T(i), dtype=dt.float64), np.linalg.norm(i.astype(F64)))


def test_any_all_count_nonzero():
    x = data((3, 4, 2), I64)
    t = T(x)
    for dim in (None, 1, (0, 2)):
        check(dt.any(t, dim), np.any(x, _axis(dim)))
        check(t.all(dim, keepdim=True), np.all(x, _axis(dim), keepdims=True))
        check(dt.count_nonzero(t, dim), np.asarray(np.count_nonzero(x, _axis(dim)), I64))


def test_logsumexp_cumsum_cumprod():
    x = data((3, 4), F64) * 300
    check(dt.logsumexp(T(x), 1), np.log(np.exp(x - x.max(1, keepdims=True)).sum(1))
          + x.max(1))
    check(dt.logsumexp(T(x), (0, 1), keepdim=True),
          np.log(np.exp(x - x.max()).sum()) + x.max() + np.zeros((1, 1)))
    inf = T(np.array([[-np.inf, -np.inf], [np.inf, 1.0]]))
    check(dt.logsumexp(inf, 1), np.array([-np.inf, np.inf]))
    check(dt.logsumexp(T(np.array([1, 2, 3])), 0), np.float32(np.log(np.exp([1, 2, 3]).sum())))
    y = data((3, 4), I32)
    check(dt.cumsum(T(y), 1), np.cumsum(y, 1, dtype=I64))
    check(T(y).cumprod(-2), np.cumprod(y, 0, dtype=I64))
    check(dt.cumsum(T(x), 0, dtype=dt.float32), np.cumsum(x, 0).astype(F32), F32, rtol=1e-5)
    check(dt.cumsum(T(np.array([True, True])), 0), np.array([1, 2]))


def test_reduction_dim_errors():
    t = T(data((2, 3), F32))
    with pytest.raises(IndexError, match="Dimension out of range"):
        t.sum(2)
    with pytest.raises(ShardingError, match="multiple times"):
        t.sum((0, -2))


# ---------------------------------------------------------------------- linear algebra

@pytest.mark.parametrize("sa,sb", [
    ((3,), (3,)), ((2, 3), (3,)), ((3,), (3, 4)), ((2, 3), (3, 4)), ((5, 2, 3), (3, 4)),
    ((5, 2, 3), (5, 3, 4)), ((1, 2, 3), (6, 3, 4)), ((7, 1, 2, 3), (5, 3, 4)),
    ((3,), (5, 3, 4)), ((5, 2, 3), (3,)), ((0, 3), (3, 2)), ((2, 0), (0, 3)),
    ((4, 5, 2, 3), (3, 4)), ((0, 2, 3), (3, 4)), ((5, 0, 3), (3, 4)), ((5, 2, 0), (0, 4)),
])
def test_matmul_shapes(sa, sb):
    for dtype in (F32, F64, I64):
        x, y = data(sa, dtype), data(sb, dtype)
        check(dt.matmul(T(x), T(y)), np.matmul(x, y), rtol=1e-5)
        check(T(x) @ T(y), x @ y, rtol=1e-5)


def test_matmul_errors_and_views():
    with pytest.raises(ShardingError, match="cannot be multiplied"):
        dt.matmul(T(data((2, 3), F32)), T(data((4, 5), F32)))
    with pytest.raises(ShardingError, match="at least 1D"):
        dt.matmul(T(np.float32(1.0)), T(data((2,), F32)))
    with pytest.raises(DTypeError, match="same dtype"):
        dt.matmul(T(data((2, 2), F32)), T(data((2, 2), F64)))
    with pytest.raises(DTypeError, match="Bool"):
        dt.matmul(T(data((2, 2), B)), T(data((2, 2), B)))
    with pytest.raises(ShardingError):
        dt.matmul(T(data((2, 2, 3), F32)), T(data((3, 3, 4), F32)))
    for (_, t, x), (_, u, y) in zip(layouts(lambda s: data(s, F64)),
                                    layouts(lambda s: data(s, F64))):
        check(t @ u.t(), x @ y.T)
        check(dt.mm(t.t(), u), x.T @ y)


def test_batched_times_matrix_in_every_layout():
    # a dense left operand's batch dims fold into rows (one BLAS call); strided ones, and
    # transposed right operands (linear's weight), must give numpy's per-batch products
    w = data((6, 4), F32)
    for x in (data((3, 5, 4), F32), data((5, 3, 4), F32).transpose(1, 0, 2),
              data((3, 5, 8), F32)[..., ::2], data((2, 3, 5, 4), F32)):
        want = np.stack([xi @ w.T for xi in x.reshape(-1, *x.shape[-2:])]).reshape(
            *x.shape[:-1], 6)
        check(T(x) @ T(w).t(), want, rtol=1e-5)
        check(dt.nn.functional.linear(T(x), T(w)), want, rtol=1e-5)
        check(T(x) @ T(np.ascontiguousarray(w.T)), want, rtol=1e-5)


def test_mm_bmm_addmm_dot_outer_linear():
    a, b = data((2, 3), F64), data((3, 4), F64)
    check(dt.mm(T(a), T(b)), a @ b)
    with pytest.raises(ShardingError):
        dt.mm(T(a), T(data((3,), F64)))
    p, q = data((5, 2, 3), F32), data((5, 3, 4), F32)
    check(dt.bmm(T(p), T(q)), p @ q, rtol=1e-5)
    with pytest.raises(ShardingError):
        dt.bmm(T(p), T(data((1, 3, 4), F32)))
    c = data((4,), F64)
    check(dt.addmm(T(c), T(a), T(b)), c + a @ b)
    check(dt.addmm(T(c), T(a), T(b), beta=0.5, alpha=2.0), 0.5 * c + 2 * (a @ b))
    nan = T(np.full((2, 4), np.nan))
    check(dt.addmm(nan, T(a), T(b), beta=0), a @ b)
    out = T(np.zeros((2, 4)))
    assert dt.addmm(out, T(a), T(b), out=out) is out
    check(out, a @ b)
    u, v = data((5,), F64), data((5,), F64)
    check(dt.dot(T(u), T(v)), np.dot(u, v))
    with pytest.raises(ShardingError):
        dt.dot(T(u), T(data((4,), F64)))
    check(dt.outer(T(u), T(v)), np.outer(u, v))
    w3 = data((3,), I64)
    check(dt.outer(T(u), T(w3)), np.outer(u, w3))
    x, w, bias = data((2, 7, 3), F32), data((4, 3), F32), data((4,), F32)
    check(dt.linear(T(x), T(w)), x @ w.T, rtol=1e-5)
    check(dt.linear(T(x), T(w), T(bias)), x @ w.T + bias, rtol=1e-5)
    check(dt.linear(T(x[0, 0]), T(w), T(bias)), x[0, 0] @ w.T + bias, rtol=1e-5)
    with pytest.raises(ShardingError):
        dt.linear(T(x), T(w), T(data((3,), F32)))


def test_einsum():
    a, b, c = data((2, 3, 4), F64), data((2, 4, 5), F64), data((5, 6), F64)
    check(dt.einsum("bij,bjk->bik", T(a), T(b)), np.einsum("bij,bjk->bik", a, b))
    check(dt.einsum("bij,bjk,kl->bil", [T(a), T(b), T(c)]),
          np.einsum("bij,bjk,kl->bil", a, b, c))
    check(dt.einsum("ii->", T(np.eye(3))), np.float64(3.0))
    v = data((4,), F64)
    check(dt.einsum("...j,j->...", T(a), T(v)), np.einsum("...j,j->...", a, v))
    big_a, big_b = data((64, 64), F64), data((64, 64), F64)
    check(dt.einsum("ij,jk->ik", T(big_a), T(big_b)), big_a @ big_b)
    with pytest.raises(ShardingError, match="einsum"):
        dt.einsum("ij,jk->ik", T(a), T(b))
    with pytest.raises(DTypeError):
        dt.einsum("i,i->", T(data((3,), F32)), T(data((3,), F64)))


# ------------------------------------------------------------------------------ joining

def test_cat_stack():
    a, b = data((2, 3), F32), data((4, 3), F64)
    check(dt.cat([T(a), T(b)]), np.concatenate([a, b]).astype(F64))
    check(dt.concat((T(a), T(a)), dim=-1), np.concatenate([a, a], 1))
    check(dt.cat([T(a), T(np.zeros((0,), F32)), T(a)]), np.concatenate([a, a]))
    check(dt.cat([T(np.zeros((0,), I64))]), np.zeros((0,), I64))
    check(dt.cat([T(np.ones((1, 3), B)), T(np.full((1, 3), 2, I32))]),
          np.array([[1] * 3, [2] * 3], I32))
    for _, t, x in layouts(lambda s: data(s, F32)):
        check(dt.cat([t, t], 1), np.concatenate([x, x], 1))
        check(dt.stack([t, t], 1), np.stack([x, x], 1))
    with pytest.raises(ShardingError, match="must match except in dimension 0"):
        dt.cat([T(a), T(data((2, 4), F32))])
    with pytest.raises(ShardingError, match="same number of dimensions"):
        dt.cat([T(a), T(data((2, 3, 1), F32))])
    with pytest.raises(ShardingError):
        dt.cat([])
    check(dt.stack([T(a), T(a)]), np.stack([a, a]))
    check(dt.stack([T(a), T(a)], dim=-1), np.stack([a, a], -1))
    check(dt.stack([T(np.float32(1)), T(np.float32(2))]), np.array([1, 2], F32))
    with pytest.raises(ShardingError, match="equal size"):
        dt.stack([T(a), T(a.T)])
    r = dt.cat([T(a), T(a)])
    r.numpy()[0, 0] = 100
    assert a[0, 0] != 100


def test_flip_roll_tril_triu_repeat_tile():
    x = data((3, 4, 2), I64)
    t = T(x)
    check(dt.flip(t, (0, 2)), np.flip(x, (0, 2)))
    check(t.flip(1), np.flip(x, 1))
    check(t.flip(0, -1), np.flip(x, (0, 2)))
    f = t.flip(0)
    f.numpy()[...] = 0
    assert x.any()
    check(dt.roll(t, 2), np.roll(x, 2))
    check(dt.roll(t, (1, -1), (0, 2)), np.roll(x, (1, -1), (0, 2)))
    check(t.roll(-1, 1), np.roll(x, -1, 1))
    with pytest.raises(ShardingError):
        dt.roll(t, (1, 2), 0)
    m = data((3, 4, 5), F32)
    check(dt.tril(T(m)), np.tril(m))
    check(dt.triu(T(m), 1), np.triu(m, 1))
    check(T(m).tril(-1), np.tril(m, -1))
    with pytest.raises(ShardingError):
        dt.tril(T(data((3,), F32)))
    check(t.repeat(2, 1, 3), np.tile(x, (2, 1, 3)))
    check(dt.repeat(t, (2, 1, 1, 2)), np.tile(x, (2, 1, 1, 2)))
    with pytest.raises(ShardingError):
        t.repeat(2, 2)
    check(dt.tile(t, (2,)), np.tile(x, (1, 1, 2)))
    check(t.tile((2, 1, 1, 1)), np.tile(x, (2, 1, 1, 1)))


# ----------------------------------------------------------------------------------- nn

def _log_softmax_ref(x, axis):
    x = x.astype(F64)
    m = x.max(axis, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis, keepdims=True))


def test_softmax_log_softmax():
    x = data((3, 4, 5), F32) * 50
    for dim in (0, 1, -1):
        check(dt.softmax(T(x), dim), np.exp(_log_softmax_ref(x, dim)).astype(F32), rtol=1e-5)
        check(dt.log_softmax(T(x), dim), _log_softmax_ref(x, dim).astype(F32), rtol=1e-5)
        check(T(x).softmax(dim), np.exp(_log_softmax_ref(x, dim)).astype(F32), rtol=1e-5)
    big = T(np.array([1000.0, 1000.0, -1000.0]))
    check(dt.softmax(big, 0), np.array([0.5, 0.5, 0.0]))
    check(dt.softmax(T(np.array([[-np.inf, -np.inf]])), 1), np.array([[np.nan, np.nan]]))
    check(dt.softmax(T(data((3,), I64)), 0, dtype=dt.float64).sum(), np.float64(1.0))
    with pytest.raises(DTypeError):
        dt.softmax(T(data((3,), I64)), 0)
    h = data((4, 6), F16)
    check(dt.softmax(T(h), 1), np.exp(_log_softmax_ref(h, 1)).astype(F16), F16)
    check(dt.softmax(T(np.float32(3.0)), 0), np.float32(1.0))
    check(dt.softmax(T(np.zeros((0, 3), F32)), 1), np.zeros((0, 3), F32))


def test_layer_norm():
    x = data((2, 3, 4), F32)
    w, b = data((3, 4), F32), data((3, 4), F32)

    def ref(x, axes, eps=1e-5):
        x = x.astype(F64)
        m = x.mean(axes, keepdims=True)
        v = ((x - m) ** 2).mean(axes, keepdims=True)
        return (x - m) / np.sqrt(v + eps)

    check(dt.layer_norm(T(x), 4), ref(x, (2,)).astype(F32), rtol=1e-5)
    check(dt.layer_norm(T(x), (3, 4), T(w), T(b), eps=1e-3),
          (ref(x, (1, 2), 1e-3) * w + b).astype(F32), rtol=1e-5)
    check(dt.layer_norm(T(x), [3, 4], weight=T(w)), (ref(x, (1, 2)) * w).astype(F32), rtol=1e-5)
    with pytest.raises(ShardingError, match="normalized_shape"):
        dt.layer_norm(T(x), (4, 3))
    with pytest.raises(ShardingError, match="weight"):
        dt.layer_norm(T(x), 4, T(w))


def test_embedding():
    w = data((10, 3), F32)
    idx = np.array([[1, 9], [0, 1]])
    check(dt.embedding(T(idx), T(w)), w[idx])
    check(dt.embedding(T(np.array(4, I32)), T(w)), w[4])
    check(dt.embedding(T(np.zeros((0,), I64)), T(w)), np.zeros((0, 3), F32))
    with pytest.raises(IndexError, match="out of range"):
        dt.embedding(T(np.array([10])), T(w))
    with pytest.raises(IndexError):
        dt.embedding(T(np.array([-1])), T(w))
    with pytest.raises(DTypeError):
        dt.embedding(T(np.array([1.0])), T(w))


def _ce_ref(x, t, weight=None, ignore_index=-100, reduction="mean", ls=0.0):
    """PyTorch's cross_entropy for class indices, written with numpy loops."""
    cdim = 1 if x.ndim >= 2 else 0
    logp = np.moveaxis(_log_softmax_ref(x, cdim), cdim, -1).reshape(-1, x.shape[cdim])
    tt = np.asarray(t).reshape(-1)
    n_cls = x.shape[cdim]
    w = np.ones(n_cls) if weight is None else weight.astype(F64)
    nll, smooth, wsum = [], [], 0.0
    for row, ti in zip(logp, tt):
        if ti == ignore_index:
            nll.append(0.0)
            smooth.append(0.0)
            continue
        nll.append(-w[ti] * row[ti])
        smooth.append(-(w * row).sum())
        wsum += w[ti]
    nll, smooth = np.array(nll), np.array(smooth)
    if reduction == "none":
        shape = np.asarray(t).shape
        return ((1 - ls) * nll + ls / n_cls * smooth).reshape(shape)
    if reduction == "sum":
        return (1 - ls) * nll.sum() + ls / n_cls * smooth.sum()
    return (1 - ls) * nll.sum() / wsum + ls / n_cls * smooth.sum() / wsum


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ls", [0.0, 0.1])
@pytest.mark.parametrize("weighted", [False, True])
def test_cross_entropy_class_indices(reduction, ls, weighted):
    x = data((6, 5), F64) * 3
    t = np.array([0, 4, -100, 2, 2, 1])
    w = data((5,), F64, positive=True) if weighted else None
    got = dt.cross_entropy(T(x), T(t), None if w is None else T(w), reduction=reduction,
                           label_smoothing=ls)
    check(got, _ce_ref(x, t, w, reduction=reduction, ls=ls))
    x3 = data((2, 5, 3), F64)
    t3 = np.array([[0, 4, 1], [2, 3, 3]])
    got = dt.cross_entropy(T(x3), T(t3), None if w is None else T(w), reduction=reduction,
                           label_smoothing=ls)
    check(got, _ce_ref(x3, t3, w, reduction=reduction, ls=ls))


def test_cross_entropy_more():
    x = data((4, 3), F32)
    check(dt.cross_entropy(T(x[0]), T(np.array(2))), np.float32(-_log_softmax_ref(x[0], 0)[2]),
          rtol=1e-5)
    check(dt.cross_entropy(T(x), T(np.array([1, 7, 0, 2])), ignore_index=7),
          np.float32(_ce_ref(x, np.array([1, 7, 0, 2]), ignore_index=7)), rtol=1e-5)
    check(dt.cross_entropy(T(x), T(np.full(4, -100))), np.float32(np.nan))
    p = np.abs(data((4, 3), F32))
    p /= p.sum(1, keepdims=True)
    lp = _log_softmax_ref(x, 1)
    check(dt.cross_entropy(T(x), T(p)), np.float32(-(lp * p).sum() / 4), rtol=1e-5)
    ps = p * 0.8 + 0.2 / 3
    check(dt.cross_entropy(T(x), T(p), reduction="none", label_smoothing=0.2),
          (-(lp * ps).sum(1)).astype(F32), rtol=1e-5)
    with pytest.raises(IndexError, match="out of bounds"):
        dt.cross_entropy(T(x), T(np.array([0, 3, 0, 0])))
    with pytest.raises(ShardingError):
        dt.cross_entropy(T(x), T(np.array([0, 1])))
    with pytest.raises(ValueError, match="reduction"):
        dt.cross_entropy(T(x), T(np.array([0, 1, 0, 0])), reduction="avg")


def test_dropout():
    x = np.ones((200, 50), F32)
    dt.manual_seed(123)
    r1 = N(dt.dropout(T(x), 0.3))
    dt.manual_seed(123)
    r2 = N(dt.dropout(T(x), 0.3))
    np.testing.assert_array_equal(r1, r2)
    assert set(np.unique(r1).tolist()) <= {0.0, np.float32(1 / 0.7)}
    assert abs((r1 == 0).mean() - 0.3) < 0.02
    r3 = N(dt.dropout(T(x), 0.3))
    assert (r3 != r1).any()
    t = T(x)
    assert dt.dropout(t, 0.5, training=False) is t
    assert dt.dropout(t, 0.0) is t
    check(dt.dropout(t, 1.0), np.zeros_like(x))
    y = x.copy()
    ty = T(y)
    assert dt.dropout(ty, 0.5, inplace=True) is ty
    assert (y == 0).any() and (y == 2).any()
    with pytest.raises(ValueError, match="between 0 and 1"):
        dt.dropout(t, 1.5)


def test_mse_loss():
    x, y = data((3, 4), F32), data((4,), F32)
    d = (x.astype(F64) - y) ** 2
    check(dt.mse_loss(T(x), T(y)), np.float32(d.mean()), rtol=1e-5)
    check(dt.mse_loss(T(x), T(y), reduction="sum"), np.float32(d.sum()), rtol=1e-5)
    check(dt.mse_loss(T(x), T(y), reduction="none"), d.astype(F32), rtol=1e-5)
    with pytest.raises(ValueError):
        dt.mse_loss(T(x), T(y), reduction="max")


# ---------------------------------------------------------------------------- in-place

def test_inplace_writes_through_views():
    base = data((4, 6), F64)
    ref = base.copy()
    b = T(base)
    v = b.t()[1::2]                                  # non-contiguous view
    assert v.add_(1.0) is v
    ref.T[1::2] += 1.0
    np.testing.assert_array_equal(base, ref)
    v.mul_(T(np.arange(4.0)))
    ref.T[1::2] *= np.arange(4.0)
    np.testing.assert_array_equal(base, ref)
    v.clamp_(-0.5, 0.5).relu_().exp_().neg_()
    ref.T[1::2] = -np.exp(np.maximum(np.clip(ref.T[1::2], -0.5, 0.5), 0))
    np.testing.assert_allclose(base, ref)
    v.pow_(2).sub_(T(np.ones(4)), alpha=2).div_(4)
    ref.T[1::2] = (ref.T[1::2] ** 2 - 2) / 4
    np.testing.assert_allclose(base, ref)
    w = b[0]
    w += 10
    w -= 1
    w *= 2
    w /= 4
    ref[0] = (ref[0] + 10 - 1) * 2 / 4
    np.testing.assert_allclose(base, ref)
    w.zero_()
    assert (base[0] == 0).all()


def test_inplace_operators_and_integer_ops():
    x = np.array([5, 7, -9])
    t = T(x)
    t //= 2
    t %= 3
    t **= 2
    t |= 8
    t &= 12
    t ^= 1
    exp = np.array([5, 7, -9])
    exp //= 2
    exp %= 3
    exp **= 2
    exp |= 8
    exp &= 12
    exp ^= 1
    np.testing.assert_array_equal(x, exp)
    y = data((3,), I64)
    exp = ~((y // 2) % 5)
    ty = T(y)
    assert ty.floor_divide_(T(np.array([2, 2, 2]))).remainder_(5).bitwise_not_() is ty
    np.testing.assert_array_equal(y, exp)


def test_inplace_errors_leave_input_unchanged():
    x = np.array([1, 2, 3])
    t = T(x)
    for bad in (lambda: t.add_(1.5), lambda: t.div_(2), lambda: t.exp_(), lambda: t.mul_(
            T(np.array([1.0, 2.0, 3.0]))), lambda: t.clamp_(0.5)):
        with pytest.raises(DTypeError, match="can't be cast to the desired output type Long"):
            bad()
        np.testing.assert_array_equal(x, [1, 2, 3])
    with pytest.raises(DTypeError, match="result type Float can't be cast"):
        t += 2.5
    with pytest.raises(ZeroDivisionError):
        t.floor_divide_(T(np.array([1, 0, 1])))
    with pytest.raises(DTypeError):
        t.pow_(T(np.array([2, -1, 2])))
    np.testing.assert_array_equal(x, [1, 2, 3])
    b = np.array([True, False])
    with pytest.raises(DTypeError):
        T(b).add_(1)
    assert b.tolist() == [True, False]
    f = np.zeros(3, F32)
    with pytest.raises(ShardingError, match="doesn't match the broadcast shape"):
        T(f).add_(T(np.ones((2, 3), F32)))
    assert (f == 0).all()
    e = T(np.zeros((1, 3), F32)).expand(4, 3)
    with pytest.raises(ViewError, match="single memory location"):
        e.add_(1)
    ti = T(np.array([1, 2], I32))
    ti.add_(T(np.array([1, 1], I64)))
    assert ti.dtype == I32 and N(ti).tolist() == [2, 3]
    tf = T(np.array([1.0, 2.0], F32))
    tf.add_(T(np.array([1, 1])))
    tf.mul_(T(np.array([2.0, 2.0], F64)))
    check(tf, np.array([4.0, 6.0], F32))


def test_out_argument():
    x, y = data((3, 4), F32), data((4,), F32)
    out = T(np.empty((3, 4), F64))
    assert dt.add(T(x), T(y), out=out) is out
    check(out, (x + y).astype(F64), rtol=1e-6)
    assert dt.exp(T(x), out=out) is out
    check(out, np.exp(x).astype(F64), rtol=1e-6)
    bo = T(np.empty((3, 4), B))
    dt.lt(T(x), T(y), out=bo)
    check(bo, x < y)
    with pytest.raises(DTypeError):
        dt.add(T(x), T(y), out=T(np.empty((3, 4), I64)))
    with pytest.raises(ShardingError):
        dt.add(T(x), T(y), out=T(np.empty((4,), F32)))


def test_large_outputs_come_from_the_allocator(monkeypatch):
    # Outputs of at least POOL_MIN_BYTES come from the caching allocator, smaller ones not.
    monkeypatch.setattr(_allocator, "POOL_MIN_BYTES", 64)
    x = T(data((16, 16), F32))
    ops = [lambda: x + x, lambda: x * 2.0, lambda: dt.exp(x), lambda: x.sum(0),
           lambda: dt.where(x > 0, x, 0.0), lambda: x @ x, lambda: dt.cat([x, x]),
           lambda: dt.softmax(x, 1), lambda: dt.clamp(x, 0.0), lambda: x.t() - 1.0]
    for op in ops:
        before = dt.memory_stats()["num_allocs"]
        r = op()
        assert dt.memory_stats()["num_allocs"] > before
        assert r.numel() * r.element_size() >= 64
    small = T(data((2, 2), F32))
    before = dt.memory_stats()["num_allocs"]
    for r in (small + small, small.sum(0), dt.exp(small)):
        assert r.numel() * r.element_size() < 64
    assert dt.memory_stats()["num_allocs"] == before


def test_any_all_of_large_outputs_are_bool(monkeypatch):
    # a pooled output buffer must have the result dtype (bool), not the input's
    monkeypatch.setattr(_allocator, "POOL_MIN_BYTES", 1)
    for dtype in (F32, I64, B):
        x = data((5, 7), dtype)
        for dim in (None, 0, (0, 1)):
            check(dt.all(T(x), dim), np.all(x, _axis(dim)))
            check(T(x).any(dim, True), np.any(x, _axis(dim), keepdims=True))


def test_methods_installed():
    t = T(data((2, 3), F32))
    for name in ("exp", "add", "sum", "max", "softmax", "clamp", "clip", "matmul", "where",
                 "flip", "add_", "clip_", "__iadd__", "__rmatmul__", "negative", "square_"):
        assert hasattr(t, name), name
    check(t.negative(), -N(t))
    check(t.square(), N(t) ** 2)
    check(T(np.array([True, False])).square(), np.array([1, 0]))
