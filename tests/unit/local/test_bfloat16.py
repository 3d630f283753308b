"""bfloat16 (ml_dtypes) and float16 on local tensors: the dtype, PyTorch's promotion table,
conversions (round to nearest even, as ml_dtypes' own cast), factories, and every op family
on small bfloat16 inputs against numpy computed in float64 on the same values and rounded
to bfloat16, within bfloat16 tolerances. Kernels compute bfloat16 in float32 and round on
store; these tests run in both dispatch modes (the runner runs the file in each).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import dtensor as dt
from dtensor.errors import DTypeError

BF16 = np.dtype(ml_dtypes.bfloat16)
F16, F32, F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)
I8, I32, I64, U8, B = (np.dtype(t) for t in (np.int8, np.int32, np.int64, np.uint8, np.bool_))
C64, C128 = np.dtype(np.complex64), np.dtype(np.complex128)
#: bfloat16 keeps 8 significand bits: one unit in the last place relative to a value
EPS = 2.0**-7


def bf(shape, seed=0, positive=False) -> np.ndarray:
    """Standard normal values rounded to bfloat16 (absolute values + 0.5 when positive)."""
    a = np.random.default_rng(seed).standard_normal(shape)
    return (np.abs(a) + 0.5 if positive else a).astype(BF16)


def T(a) -> dt.Tensor:
    return dt.from_numpy(np.ascontiguousarray(a))


def close(got, want, rtol=EPS, scale=None):
    """``got`` (a Tensor) is bfloat16 and within bfloat16 rounding of ``want`` (float64
    values, rounded to bfloat16 here): ``rtol`` of each value plus ``rtol`` of ``scale``
    (the magnitude of what was summed; default the largest |want|)."""
    assert got.dtype == BF16, got.dtype
    g = np.asarray(got.numpy(), np.float64)
    w = np.asarray(np.asarray(want).astype(BF16), np.float64)
    s = float(np.max(np.abs(w), initial=1.0)) if scale is None else scale
    np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * s)


# -- the dtype --------------------------------------------------------------------------------
def test_dtype_names_and_kinds():
    assert dt.bfloat16 == BF16 and dt.bfloat16.itemsize == 2
    t = dt.tensor([1.5, -2.25], dtype=dt.bfloat16)
    assert t.dtype == BF16 and t.is_floating_point() and not t.is_complex()
    assert dt.tensor([1.0], dtype="bfloat16").dtype == BF16
    assert dt.zeros(2, dtype=dt.half).dtype == F16
    assert t[0].item() == 1.5 and type(t[0].item()) is float
    assert t.tolist() == [1.5, -2.25]
    assert t.numpy().dtype == BF16  # an ml_dtypes array, zero-copy
    assert "dtype=dt.bfloat16" in repr(t) and "1.5000" in repr(t)
    assert float(dt.tensor(3.0, dtype=dt.bfloat16)) == 3.0


PROMOTION = [  # PyTorch's torch.promote_types for bfloat16
    (BF16, F16, F32), (BF16, F32, F32), (BF16, F64, F64), (BF16, C64, C64),
    (BF16, C128, C128), (BF16, I64, BF16), (BF16, I8, BF16), (BF16, U8, BF16),
    (BF16, B, BF16), (BF16, BF16, BF16), (F16, I32, F16), (F16, F32, F32),
]


@pytest.mark.parametrize("a, b, want", PROMOTION)
def test_promotion_follows_pytorch(a, b, want):
    x, y = T(np.ones(2, a)), T(np.ones(2, b))
    assert (x + y).dtype == want and (y + x).dtype == want
    assert (x * y).dtype == want


def test_scalars_and_zero_dim_tensors_are_weak():
    x = T(bf(3))
    assert (x + 2.5).dtype == BF16 and (2 * x).dtype == BF16 and (x / 3).dtype == BF16
    assert (x + dt.tensor(1.0, dtype=dt.float64)).dtype == BF16  # 0-d of the same category
    assert (T(np.arange(3)) + dt.tensor(1.0, dtype=dt.bfloat16)).dtype == BF16
    assert (x > 0).dtype == B
    assert (x + x.numpy()[0]).dtype == BF16  # an ml_dtypes scalar is a python float here
    assert (T(np.arange(3)) * x.numpy()[0]).dtype == F32
    dt.set_default_dtype(dt.bfloat16)
    try:
        assert dt.tensor([1.0]).dtype == BF16 and (T(np.arange(3)) / 2).dtype == BF16
    finally:
        dt.set_default_dtype(dt.float32)


# -- conversions ------------------------------------------------------------------------------
def test_conversion_rounds_to_nearest_even_as_ml_dtypes():
    # ties between two bfloat16 values (the low 16 bits are 0x8000) go to the even one
    bits = np.array([0x3F808000, 0x3F818000, 0xBF808000, 0x3F80C000, 0x3F807FFF,
                     0x7F7FFFFF, 0x7F800000, 0x7FC00000, 0x00000001], np.uint32)
    x = bits.view(np.float32)
    got = T(x).to(dt.bfloat16).numpy().view(np.uint16)
    assert got.tolist() == [0x3F80, 0x3F82, 0xBF80, 0x3F81, 0x3F80, 0x7F80, 0x7F80,
                            got[7], 0x0000]
    assert np.isnan(T(x).to(dt.bfloat16).numpy()[7])
    rand = np.random.default_rng(1).standard_normal(1000).astype(np.float32) * 1e3
    for src in (rand, rand.astype(np.float64), rand.astype(np.float16)):
        np.testing.assert_array_equal(T(src).to(dt.bfloat16).numpy().view(np.uint16),
                                      src.astype(BF16).view(np.uint16))
    back = T(rand).bfloat16().float().numpy()
    np.testing.assert_array_equal(back, rand.astype(BF16).astype(np.float32))
    assert T(np.arange(5)).to(dt.bfloat16).to(dt.int64).tolist() == [0, 1, 2, 3, 4]


def test_factories():
    for make in (dt.zeros, dt.ones, dt.empty):
        assert make(2, 3, dtype=dt.bfloat16).dtype == BF16
    assert dt.full((2,), 0.1, dtype=dt.bfloat16).numpy().view(np.uint16).tolist() == [0x3DCD] * 2
    dt.manual_seed(5)
    u = dt.rand(4096, dtype=dt.bfloat16).numpy().astype(np.float64)
    assert u.min() >= 0 and u.max() < 1 and np.all(u * 256 == np.floor(u * 256))
    dt.manual_seed(5)
    n = dt.randn(4096, dtype=dt.bfloat16)
    dt.manual_seed(5)
    ref = dt.randn(4096, dtype=dt.float64).numpy()
    close(n, ref, rtol=EPS / 2)
    assert abs(float(n.float().mean())) < 0.1
    with pytest.raises(DTypeError):
        dt.randn(2, dtype=dt.int32)


# -- elementwise ------------------------------------------------------------------------------
UNARY = {
    "neg": np.negative, "abs": np.abs, "exp": np.exp, "log": np.log, "sqrt": np.sqrt,
    "rsqrt": lambda x: 1 / np.sqrt(x), "sin": np.sin, "tanh": np.tanh, "floor": np.floor,
    "sigmoid": lambda x: 1 / (1 + np.exp(-x)), "relu": lambda x: np.maximum(x, 0),
    "square": np.square, "reciprocal": lambda x: 1 / x, "round": np.rint,
    "gelu": lambda x: x * 0.5 * (1 + np.vectorize(__import__("math").erf)(x / np.sqrt(2))),
    "silu": lambda x: x / (1 + np.exp(-x)),
}


@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary(name):
    x = bf((4, 5), seed=2, positive=name in ("log", "sqrt", "rsqrt", "reciprocal"))
    fn = getattr(dt, name)
    close(fn(T(x)), UNARY[name](x.astype(F64)))
    close(fn(T(x.T)), UNARY[name](x.T.astype(F64)))  # a non-contiguous input


def test_unary_bool_results_and_errors():
    x = np.array([1.0, np.nan, np.inf, -2.0], BF16)
    assert dt.isnan(T(x)).tolist() == [False, True, False, False]
    assert dt.isfinite(T(x)).tolist() == [True, False, False, True]
    with pytest.raises(DTypeError):
        dt.bitwise_not(T(x))


BINARY = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
    "maximum": np.maximum, "minimum": np.minimum, "atan2": np.arctan2, "pow": np.power,
    "remainder": lambda a, b: a - np.floor(a / b) * b,
}


@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary_with_broadcasting_and_scalars(name):
    x, y = bf((3, 4), seed=3, positive=True), bf((4,), seed=4, positive=True)
    fn, ref = getattr(dt, name), BINARY[name]
    close(fn(T(x), T(y)), ref(x.astype(F64), y.astype(F64)))
    close(fn(T(x), 1.3), ref(x.astype(F64), np.float64(np.float32(1.3))))
    k = (y.astype(F64) * 3 + 1).astype(np.int64)  # integers >= 2
    close(fn(T(x), T(k)), ref(x.astype(F64), k.astype(F64)))


def test_binary_mixed_float16_computes_in_float32_and_ops_write_in_place():
    x, y = bf(6, seed=5), np.random.default_rng(6).standard_normal(6).astype(F16)
    r = T(x) * T(y)
    assert r.dtype == F32
    np.testing.assert_allclose(r.numpy(), x.astype(F32) * y.astype(F32), rtol=1e-6)
    t = T(x.copy())
    t.add_(T(y.astype(BF16)), alpha=2)
    close(t, x.astype(F64) + 2 * y.astype(BF16).astype(F64))
    t.mul_(0.5)
    close(t, (x.astype(F64) + 2 * y.astype(BF16).astype(F64)) * 0.5, rtol=2 * EPS)
    cmp = T(x) < T(y.astype(BF16))
    assert cmp.dtype == B and cmp.tolist() == (x.astype(F32) < y.astype(BF16).astype(F32)).tolist()


def test_ternary_ops():
    x, y, z = bf(8, 7), bf(8, 8), bf(8, 9, positive=True)
    c = x.astype(F32) > 0
    got = dt.where(T(c), T(x), T(y))
    assert got.dtype == BF16 and np.array_equal(got.numpy(), np.where(c, x, y))
    close(dt.clamp(T(x), -0.5, 0.5), np.clip(x.astype(F64), -0.5, 0.5))
    close(dt.lerp(T(x), T(y), 0.3), x.astype(F64) + 0.3 * (y.astype(F64) - x.astype(F64)))
    xf, yf, zf = (v.astype(F64) for v in (x, y, z))
    close(dt.addcmul(T(x), T(y), T(z), value=0.5), xf + 0.5 * yf * zf)
    close(dt.addcdiv(T(x), T(y), T(z)), xf + yf / zf, scale=float(np.max(np.abs(yf / zf))))


# -- reductions (accumulated in float32, rounded once) -----------------------------------------
def test_reductions():
    x = bf((64, 33), seed=10)
    xf = x.astype(F64)
    mag = float(np.abs(xf).sum())
    close(dt.sum(T(x)), xf.sum(), scale=mag * 2**-10)
    close(T(x).sum(1), xf.sum(1), scale=float(np.abs(xf).sum(1).max()) * 2**-10)
    close(T(x).mean(0), xf.mean(0))
    close(T(x).var(1), xf.var(1, ddof=1))
    close(T(x).std(), xf.std(ddof=1))
    close(T(x).norm(), np.sqrt((xf * xf).sum()))
    close(dt.logsumexp(T(x), 1), np.log(np.exp(xf).sum(1)))
    close(T(x).cumsum(1), np.cumsum(xf, 1), scale=float(np.abs(xf).sum(1).max()))
    close(T(x[:4, :6]).prod(1), xf[:4, :6].prod(1))
    for op in ("amax", "amin"):
        got = getattr(T(x), op)(1)
        assert got.dtype == BF16 and np.array_equal(got.numpy(), getattr(np, op)(x, 1))
    assert T(x).argmax(1).tolist() == np.argmax(xf, 1).tolist()
    values, idx = T(x).max(0)
    assert values.dtype == BF16 and idx.tolist() == np.argmax(xf, 0).tolist()
    nan = np.array([1.0, np.nan, 3.0], BF16)
    assert np.isnan(float(T(nan).amax())) and np.isnan(float(T(nan).sum()))


def test_sum_accumulates_in_float32():
    # 4096 ones: a bfloat16 running sum would stop at 256 (256 + 1 rounds to 256)
    assert T(np.ones(4096, BF16)).sum().item() == 4096.0
    assert T(np.ones((2, 4096), F16)).sum(1).tolist() == [4096.0, 4096.0]
    assert T(np.ones(1024, BF16)).cumsum(0)[-1].item() == 1024.0


# -- linear algebra (float32 products and sums, one rounding) ----------------------------------
def test_matmul_family():
    a, b, c = bf((5, 64), 11), bf((64, 3), 12), bf((5, 3), 13)
    af, bf_, cf = a.astype(F64), b.astype(F64), c.astype(F64)
    scale = float((np.abs(af) @ np.abs(bf_)).max())
    close(T(a) @ T(b), af @ bf_, scale=scale)
    close(dt.matmul(T(a[None]), T(b[None])), (af @ bf_)[None], scale=scale)
    close(dt.addmm(T(c), T(a), T(b), beta=0.5, alpha=2), 0.5 * cf + 2 * af @ bf_,
          scale=2 * scale)
    close(dt.linear(T(a), T(b.T.copy()), T(c[0])), af @ bf_ + cf[0], scale=scale)
    close(dt.einsum("ij,jk->ik", T(a), T(b)), af @ bf_, scale=scale)
    close(dt.dot(T(a[0]), T(b[:, 0])), af[0] @ bf_[:, 0], scale=scale)
    h = a.astype(F16) @ b.astype(F16)  # float16 accumulates in float32 too
    got = T(a.astype(F16)) @ T(b.astype(F16))
    assert got.dtype == F16
    np.testing.assert_allclose(got.numpy().astype(F64), (af @ bf_), atol=2e-3 * scale)
    assert h.dtype == F16
    with pytest.raises(DTypeError):
        T(a) @ T(b.astype(F32))


# -- nn ---------------------------------------------------------------------------------------
def _softmax(x, axis):
    e = np.exp(x - x.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


def test_nn_ops():
    F = dt
    x, w, bias = bf((6, 10), 20), bf(10, 21), bf(10, 22)
    xf = x.astype(F64)
    close(F.softmax(T(x), -1), _softmax(xf, -1))
    close(F.softmax(T(x), 0), _softmax(xf, 0))
    close(F.log_softmax(T(x), 1), np.log(_softmax(xf, 1)))
    mu, var = xf.mean(1, keepdims=True), xf.var(1, keepdims=True)
    ref = (xf - mu) / np.sqrt(var + 1e-5) * w.astype(F64) + bias.astype(F64)
    close(F.layer_norm(T(x), (10,), T(w), T(bias)), ref)
    target = np.array([1, 0, 9, 3, 3, 7])
    logp = np.log(_softmax(xf, 1))
    close(F.cross_entropy(T(x), T(target)), -logp[np.arange(6), target].mean())
    close(F.mse_loss(T(x), T(x[::-1].copy())), ((xf - xf[::-1]) ** 2).mean())
    drop = F.dropout(T(x), 0.5)
    kept = drop.numpy().astype(F64) != 0
    assert drop.dtype == BF16
    np.testing.assert_array_equal(drop.numpy().astype(F64)[kept], 2 * xf[kept])
    emb = F.embedding(T(np.array([2, 0])), T(x))
    assert emb.dtype == BF16 and np.array_equal(emb.numpy(), x[[2, 0]])


# -- shape, index and join ops keep the bits --------------------------------------------------
def test_data_movement_keeps_bits():
    x = bf((4, 6), 30)
    t = T(x)
    same = [t.T.contiguous(), t[1:3, ::2], dt.cat([t, t]), dt.stack([t, t], 1), t.flip(0),
            t.reshape(6, 4), t.clone(), t.index_select(0, T(np.array([3, 1])))]
    refs = [x.T, x[1:3, ::2], np.concatenate([x, x]), np.stack([x, x], 1), x[::-1],
            x.reshape(6, 4), x, x[[3, 1]]]
    for got, want in zip(same, refs):
        assert got.dtype == BF16 and np.array_equal(got.numpy().view(np.uint16),
                                                    np.ascontiguousarray(want).view(np.uint16))
    vals = t.sort(1).values
    assert np.array_equal(vals.numpy(), np.sort(x.astype(F32), 1).astype(BF16))
    assert np.array_equal(dt.topk(t, 2).values.numpy(), -np.sort(-x.astype(F32), 1)[:, :2])
    u = T(x.copy())
    u[0] = 0.1
    u[1, 2] = T(np.array(2.5, BF16))
    assert u.numpy()[0].view(np.uint16).tolist() == [0x3DCD] * 6 and float(u[1, 2]) == 2.5


# -- autograd ---------------------------------------------------------------------------------
def test_backward_in_bfloat16():
    a, b = bf((4, 8), 40), bf((8, 3), 41)
    x, w = T(a).requires_grad_(), T(b).requires_grad_()
    loss = dt.gelu(x @ w).sum()
    loss.backward()
    assert x.grad.dtype == BF16 and w.grad.dtype == BF16
    xf, wf = T(a.astype(F32)).requires_grad_(), T(b.astype(F32)).requires_grad_()
    dt.gelu(xf @ wf).sum().backward()
    close(x.grad, xf.grad.numpy(), rtol=4 * EPS)
    close(w.grad, wf.grad.numpy(), rtol=4 * EPS)


# --- ml_dtypes is imported on first need (its import costs about 0.8 s of CPU) -------------
_NO_ML_DTYPES = """
import sys
import dtensor as dt
from dtensor.checkpoint import _common
from redistribute.cost import WIDENED
x = dt.ones(4) * 2
assert float(x.sum()) == 8.0 and (dt.randn(3, 2) @ dt.randn(2, 3)).shape == (3, 3)
assert (x.to(dt.float16) + 1).dtype == dt.float16 and x.to("half").dtype == dt.float16
assert dt.float32 not in WIDENED and WIDENED.get(dt.float64) is None
assert _common.dtype_name(dt.float32) == "<f4"
assert "ml_dtypes" not in sys.modules, "import dtensor (and float32 ops) imported ml_dtypes"
bf16 = dt.bfloat16
assert "ml_dtypes" in sys.modules and bf16.name == "bfloat16" and bf16.char == "E"
assert WIDENED[bf16] == dt.float32 and bf16 in WIDENED
print("ok")
"""


def test_import_dtensor_leaves_ml_dtypes_out():
    import subprocess  # lazy: one test's child process
    import sys  # lazy: as above

    out = subprocess.run([sys.executable, "-c", _NO_ML_DTYPES], capture_output=True,
                         text=True, timeout=300, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_dtype_table_adds_bfloat16_on_first_lookup():
    from placements.meta import DtypeTable, bfloat16, is_bfloat16  # lazy: this test's names

    table = DtypeTable({F32: 1}, lambda b: {b: 2, "bfloat16": 3})
    assert table.get(F64) is None and F16 not in table and table[F32] == 1
    assert dict.__len__(table) == 1  # no void dtype or "bfloat16" asked yet
    assert BF16 in table and table[BF16] == 2 and table["bfloat16"] == 3
    fresh = DtypeTable({F32: 1}, lambda b: {b: 2})
    assert fresh.get(BF16) == 2 and len(fresh) == 2
    other = DtypeTable({}, lambda b: {b: 2})
    assert sorted(map(str, other)) == ["bfloat16"]  # iteration lists the late entries
    with pytest.raises(KeyError):
        DtypeTable({}, lambda b: {b: 2})[F32]
    assert bfloat16() == BF16 and is_bfloat16(BF16) and is_bfloat16(ml_dtypes.bfloat16)
    assert not any(is_bfloat16(d) for d in (F16, F32, np.dtype("V2"), None, "bfloat16"))
