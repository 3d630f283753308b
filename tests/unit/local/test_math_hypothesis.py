"""Property tests of the local math kernels: random shapes (size-0 dims included),
broadcasts, dtypes (bool, uint8, int32, int64, float16, float32, float64), values (NaN,
infinities and -0.0 among the floats), memory layouts (contiguous, permuted, stepped,
negative-stride and expanded stride-0 views), python scalars and reduction dims, compared
with numpy (NaN equal to NaN).

Expected dtypes come from PyTorch's promotion rule, written here independently of the
library: among tensors, the higher category (bool < integer < floating) wins and within a
category the wider dtype; a python scalar only matters when its category is higher than
the tensor's (int -> int64, float -> the default float dtype, float32); a 0-d tensor beside
a dimensioned one acts the same way with its own dtype.

Example counts scale with the hypothesis profile (``HYPOTHESIS_PROFILE``, see
``tests/conftest.py``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import dtensor as dt
from dtensor.errors import DTypeError, ViewError

DTYPES = [np.dtype(t) for t in (np.bool_, np.uint8, np.int32, np.int64, np.float16, np.float32,
                                np.float64)]
FLOATS = [d for d in DTYPES if d.kind == "f"]
CAT = {"b": 0, "i": 1, "u": 1, "f": 2}
SPECIALS = (math.nan, math.inf, -math.inf, -0.0)
#: These tests draw several tensors per example: 1.5 times the profile's examples.
SETTINGS = settings(max_examples=settings.default.max_examples * 3 // 2)
#: A simple property: half the profile's examples.
FEW = settings(max_examples=max(1, settings.default.max_examples // 2))

# numpy's floating-point warnings (inf/nan results, means of empty slices) are expected here.
pytestmark = [pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:Mean of empty slice:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:Degrees of freedom:RuntimeWarning")]


def torch_promote(d1, d2):
    c1, c2 = CAT[d1.kind], CAT[d2.kind]
    if c1 != c2:
        return d1 if c1 > c2 else d2
    return d1 if d1.itemsize >= d2.itemsize else d2


def tensors_promote(d1, s1, d2, s2):
    """Result dtype of two tensors of shapes s1, s2: a 0-d tensor beside a dimensioned one
    only matters when its category is higher."""
    if bool(s1) == bool(s2):
        return torch_promote(d1, d2)
    dim_d, zero_d = (d1, d2) if s1 else (d2, d1)
    return zero_d if CAT[zero_d.kind] > CAT[dim_d.kind] else dim_d


def scalar_promote(dtype, value):
    cat = 0 if isinstance(value, bool) else 1 if isinstance(value, int) else 2
    if cat > CAT[dtype.kind]:
        return np.dtype({1: np.int64, 2: np.float32}[cat])
    return dtype


def elements(dtype):
    if dtype.kind == "b":
        return st.booleans()
    if dtype.kind == "u":
        return st.integers(0, 255)
    if dtype.kind == "i":
        return st.integers(-20, 20)
    return st.floats(-10, 10, width=8 * dtype.itemsize)


@st.composite
def arrays(draw, dtype, shape):
    """A C-contiguous array; half of the floating ones hold a few NaN, inf, -inf or -0.0."""
    a = draw(hnp.arrays(dtype, tuple(shape), elements=elements(dtype)))
    if dtype.kind == "f" and a.size and draw(st.booleans()):
        flat = a.reshape(-1)
        for i in draw(st.lists(st.integers(0, a.size - 1), min_size=1, max_size=3)):
            flat[i] = draw(st.sampled_from(SPECIALS))
    return a


@st.composite
def stored_view(draw, dtype, shape, writable=False):
    """A stored array and a function giving the view of ``shape`` on it (or on a Tensor of
    it): contiguous, permuted, stepped (steps of +-1 and +-2; negative ones through numpy,
    as Tensor indexing takes none) or, unless ``writable``, expanded (stride 0)."""
    shape = tuple(shape)
    layouts = ["contiguous", "permuted", "stepped"] + ([] if writable else ["expanded"])
    layout = draw(st.sampled_from(layouts))
    if layout == "permuted" and len(shape) > 1:
        perm = draw(st.permutations(range(len(shape))))
        inv = tuple(int(i) for i in np.argsort(perm))
        stored = draw(arrays(dtype, tuple(shape[p] for p in perm)))

        def view(a):
            return a.permute(*inv) if isinstance(a, dt.Tensor) else a.transpose(inv)

        return stored, view
    if layout == "stepped" and shape:
        steps = [draw(st.sampled_from([1, 2, -1, -2])) for _ in shape]
        stored = draw(arrays(dtype, tuple(n * abs(s) for n, s in zip(shape, steps))))
        index = tuple(slice(None, None, s) for s in steps)

        def view(a):
            if isinstance(a, dt.Tensor) and min(steps) < 0:
                return dt.from_numpy(a.numpy()[index])  # negative strides, same memory
            return a[index]

        return stored, view
    if layout == "expanded" and shape:
        small = tuple(1 if draw(st.booleans()) else n for n in shape)
        lead = draw(st.integers(0, len(shape)))  # leading dims the expand adds
        stored = draw(arrays(dtype, small[lead:]))

        def view(a):
            return a.expand(*shape) if isinstance(a, dt.Tensor) else np.broadcast_to(a, shape)

        return stored, view
    return draw(arrays(dtype, shape)), lambda a: a


@st.composite
def tensor_and_array(draw, dtype, shape):
    """A Tensor of ``shape`` (one of the layouts of :func:`stored_view`) and its values."""
    stored, view = draw(stored_view(dtype, shape))
    return view(dt.from_numpy(stored)), view(stored)


TOL = {2: 1e-2, 4: 1e-5, 8: 1e-12}  # float16, float32, float64, relative to the magnitude


def assert_matches(t, expected, dtype, scale=1.0):
    """``t`` has ``dtype`` and the values ``expected`` (NaN equal to NaN; floats within a
    tolerance relative to ``scale`` and to the largest finite expected value)."""
    assert t.dtype == dtype, (t.dtype, dtype)
    got = np.asarray(t.numpy())
    expected = np.asarray(expected)
    assert got.shape == expected.shape
    if dtype.kind == "f":
        finite = np.abs(expected[np.isfinite(expected)])
        tol = TOL[dtype.itemsize]
        atol = tol * max(1.0, scale, float(finite.max(initial=0)))
        np.testing.assert_allclose(got, expected.astype(dtype), rtol=tol, atol=atol,
                                   equal_nan=True)
    else:
        np.testing.assert_array_equal(got, expected)


ARITH = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "maximum": np.maximum,
         "minimum": np.minimum, "floor_divide": np.floor_divide, "remainder": np.remainder}
COMPARE = {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal,
           "gt": np.greater, "ge": np.greater_equal}
DIVISION = {"floor_divide", "remainder"}


@SETTINGS
@given(st.data(),
       hnp.mutually_broadcastable_shapes(num_shapes=2, max_dims=4, min_side=0, max_side=4),
       st.sampled_from(DTYPES), st.sampled_from(DTYPES),
       st.sampled_from(sorted(ARITH) + sorted(COMPARE) + ["div"]))
def test_binary_broadcast_against_numpy(data, shapes, d1, d2, name):
    (s1, s2), out_shape = shapes
    t1, x1 = data.draw(tensor_and_array(d1, s1))
    t2, x2 = data.draw(tensor_and_array(d2, s2))
    rt = tensors_promote(d1, s1, d2, s2)
    fn = getattr(dt, name)
    if name in DIVISION:
        assume(rt.kind != "b")
        if rt.kind != "f" and not np.all(x2):
            with pytest.raises(ZeroDivisionError):
                fn(t1, t2)
            return
    if name == "sub" and rt.kind == "b":
        with pytest.raises(DTypeError):
            fn(t1, t2)
        return
    if name in COMPARE:
        assert_matches(fn(t1, t2), COMPARE[name](x1.astype(rt), x2.astype(rt)), np.dtype(bool))
        return
    if name == "div":
        rt = rt if rt.kind == "f" else np.dtype(np.float32)
        expected = np.true_divide(x1.astype(rt), x2.astype(rt))
    else:
        expected = ARITH[name](x1.astype(rt), x2.astype(rt))
    r = fn(t1, t2)
    assert tuple(r.shape) == tuple(out_shape)
    assert_matches(r, expected, rt)


SCALARS = st.one_of(st.booleans(), st.integers(-5, 5), st.floats(-4, 4),
                    st.sampled_from([math.nan, math.inf, -math.inf]))


@SETTINGS
@given(st.data(), hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4),
       st.sampled_from(DTYPES), SCALARS,
       st.sampled_from(["add", "sub", "mul", "maximum", "lt", "ge"]), st.booleans())
def test_python_scalars_both_sides(data, shape, dtype, scalar, name, scalar_first):
    t, x = data.draw(tensor_and_array(dtype, shape))
    rt = scalar_promote(dtype, scalar)
    args = (scalar, t) if scalar_first else (t, scalar)
    if name == "sub" and rt.kind == "b":
        with pytest.raises(DTypeError):
            getattr(dt, name)(*args)
        return
    # an int scalar wraps into an unsigned dtype like a C cast (uint8 tensor + -3)
    xs = (np.asarray(scalar).astype(rt), x.astype(rt))
    ref = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "maximum": np.maximum,
           **COMPARE}[name](*(xs if scalar_first else xs[::-1]))
    expected_dtype = np.dtype(bool) if name in COMPARE else rt
    assert_matches(getattr(dt, name)(*args), ref, expected_dtype)
    if name in ("add", "sub", "mul", "lt", "ge"):
        op = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
              "lt": lambda a, b: a < b, "ge": lambda a, b: a >= b}[name]
        assert_matches(op(*args), ref, expected_dtype)


INT_DTYPES = ["uint8", "int8", "int16", "int32", "int64"]


@pytest.mark.parametrize("dtype", INT_DTYPES)
@pytest.mark.parametrize("shape", [(), (3,), (8, 8), (8192,)])
def test_compare_with_an_out_of_range_int_wraps(dtype, shape):
    # README: an out-of-range python int wraps like a C cast (uint8: -1 is 255), as in
    # PyTorch (torch.zeros(3, dtype=torch.uint8) < -1 is all True, int8 > 200 compares with
    # -56). The result must not depend on the tensor's size: 0-d and pooled-size tensors
    # take the slow path, the others the short path (numpy 2 alone compares exactly there).
    x = np.asarray(np.arange(math.prod(shape)).reshape(shape) % 7 - 3).astype(dtype)
    t = dt.from_numpy(x)
    for value in (-1, 200, 256, 300, -129, 128, 2**31, 2**40, 2**63):
        w = np.asarray(value).astype(dtype)  # the C cast
        for name, np_op in COMPARE.items():
            expected = np_op(x, w)
            assert_matches(getattr(dt, name)(t, value), expected, np.dtype(bool))
            assert_matches(getattr(dt, name)(value, t), np_op(w, x), np.dtype(bool))
        assert_matches(t < value, x < w, np.dtype(bool))
        assert_matches(value < t, w < x, np.dtype(bool))
        assert_matches(t == value, x == w, np.dtype(bool))
        assert_matches(t != value, x != w, np.dtype(bool))
        # arithmetic wraps the same way (numpy would raise OverflowError)
        for name, np_op in (("add", np.add), ("sub", np.subtract), ("mul", np.multiply)):
            assert_matches(getattr(dt, name)(t, value), np_op(x, w), np.dtype(dtype))


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


# name -> (dtype rule, numpy reference); rules as in dtensor/ops/pointwise.py: "same" keeps
# the dtype (bool refused), "float" computes bools and integers in float32, "round" returns
# bools and integers unchanged, "bool" returns bool, "square" squares bool to int64.
UNARY = {
    "neg": ("same", np.negative), "abs": ("same", np.abs),
    "relu": ("same", lambda x: np.maximum(x, x.dtype.type(0))), "sign": ("sign", np.sign),
    "exp": ("float", np.exp), "log": ("float", np.log), "sqrt": ("float", np.sqrt),
    "tanh": ("float", np.tanh), "sigmoid": ("float", _sigmoid),
    "reciprocal": ("float", np.reciprocal), "floor": ("round", np.floor),
    "round": ("round", np.rint), "isnan": ("bool", np.isnan), "isfinite": ("bool", np.isfinite),
    "logical_not": ("bool", np.logical_not), "square": ("square", np.square),
}


@SETTINGS
@given(st.data(), hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4),
       st.sampled_from(DTYPES), st.sampled_from(sorted(UNARY)))
def test_unary_against_numpy(data, shape, dtype, name):
    t, x = data.draw(tensor_and_array(dtype, shape))
    rule, ref = UNARY[name]
    fn = getattr(dt, name)
    if rule == "same" and dtype.kind == "b":
        with pytest.raises(DTypeError):
            fn(t)
        return
    if rule == "float":
        rt = dtype if dtype.kind == "f" else np.dtype(np.float32)
        # float16 computes through float32, the result rounded once
        expected = ref(x.astype(np.float32 if rt.itemsize == 2 else rt))
    elif rule == "bool":
        rt, expected = np.dtype(bool), ref(x)
    elif rule == "square" and dtype.kind == "b":
        rt, expected = np.dtype(np.int64), x.astype(np.int64)
    elif dtype.kind == "b" and rule == "sign" or dtype.kind in "bui" and rule == "round":
        rt, expected = dtype, x  # sign(bool) is itself (numpy has no sign of bools)
    else:
        rt, expected = dtype, ref(x)
    assert_matches(fn(t), expected, rt)


@st.composite
def reduction_case(draw):
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=4))
    ndim = len(shape)
    kind = draw(st.sampled_from(["none", "int", "tuple"]) if ndim else st.just("none"))
    if kind == "none":
        dim = None
    elif kind == "int":
        dim = draw(st.integers(-ndim, ndim - 1))
    else:
        dims = draw(st.lists(st.integers(0, ndim - 1), min_size=1, max_size=ndim, unique=True))
        dim = tuple(d - ndim if draw(st.booleans()) else d for d in dims)
    return shape, dim, draw(st.booleans())


def _axes(dim, ndim):
    if dim is None:
        return None
    dims = (dim,) if isinstance(dim, int) else dim
    return tuple(d % ndim for d in dims)


@SETTINGS
@given(st.data(), reduction_case(), st.sampled_from(DTYPES),
       st.sampled_from(["sum", "prod", "mean", "amax", "amin", "any", "all", "std"]))
def test_reductions_against_numpy(data, case, dtype, name):
    shape, dim, keepdim = case
    t, x = data.draw(tensor_and_array(dtype, shape))
    axes = _axes(dim, len(shape))
    n_reduced = x.size if axes is None else math.prod(x.shape[a] for a in axes)
    if name in ("sum", "prod"):
        rt = np.dtype(np.int64) if dtype.kind in "biu" else dtype
        # float16 accumulates in float32 (as PyTorch on CPU), rounded once at the end
        acc = np.dtype(np.float32) if rt.itemsize == 2 else rt
        ref = getattr(np, name)(x, axis=axes, dtype=acc, keepdims=keepdim)
        # a sum's rounding errors scale with the magnitudes summed
        scale = float(np.nansum(np.abs(np.where(np.isinf(x), 0, x)), dtype=np.float64))
        assert_matches(getattr(dt, name)(t, dim, keepdim), ref, rt,
                       scale if name == "sum" else 1.0)
    elif name in ("mean", "std"):
        if dtype.kind != "f":
            with pytest.raises(DTypeError):
                getattr(dt, name)(t, dim, keepdim)
            return
        kw = {"ddof": 1} if name == "std" else {}
        ref = getattr(np, name)(x.astype(np.float64), axis=axes, keepdims=keepdim, **kw)
        assert_matches(getattr(dt, name)(t, dim, keepdim=keepdim), ref, dtype)
    elif name in ("amax", "amin"):
        if n_reduced == 0:  # no identity: PyTorch raises IndexError
            with pytest.raises((IndexError, ValueError)):
                getattr(dt, name)(t, () if dim is None else dim, keepdim)
            return
        ref = getattr(np, name)(x, axis=axes, keepdims=keepdim)
        assert_matches(getattr(dt, name)(t, () if dim is None else dim, keepdim), ref, dtype)
    else:
        ref = getattr(np, name)(x, axis=axes, keepdims=keepdim)
        assert_matches(getattr(dt, name)(t, dim, keepdim), ref, np.dtype(bool))


@SETTINGS
@given(st.data(), hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=5),
       st.sampled_from([np.dtype(t) for t in (np.uint8, np.int64, np.float16, np.float64)]),
       st.booleans())
def test_max_with_dim_and_argmax_first_occurrence(data, shape, dtype, keepdim):
    # Small integer ranges make ties frequent: indices must be the first occurrence (of a
    # NaN, when there is one: NaN is the maximum and the minimum, as in numpy and PyTorch).
    t, x = data.draw(tensor_and_array(dtype, shape))
    x = np.asarray(x)
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    if shape[dim] == 0:  # no identity: PyTorch raises IndexError naming the op
        with pytest.raises((IndexError, ValueError), match=r"^max\(\)"):
            dt.max(t, dim, keepdim)
        with pytest.raises((IndexError, ValueError), match=r"^argmin\(\)"):
            dt.argmin(t, dim, keepdim)
        return
    values, indices = dt.max(t, dim, keepdim)
    assert_matches(values, np.max(x, axis=dim, keepdims=keepdim), dtype)
    assert_matches(indices, np.argmax(x, axis=dim, keepdims=keepdim), np.dtype(np.int64))
    assert_matches(dt.argmin(t, dim, keepdim), np.argmin(x, axis=dim, keepdims=keepdim),
                   np.dtype(np.int64))


@pytest.mark.parametrize("name", ["max", "min", "argmax", "argmin"])
def test_max_min_over_an_empty_dim_name_the_op(name):
    # found by the property test above: max/min over a size-0 dim raised naming argmax
    with pytest.raises(ValueError, match=rf"^{name}\(\): expected reduction dim"):
        getattr(dt, name)(dt.zeros(2, 0), 1)


@SETTINGS
@given(st.data(), st.integers(0, 4), st.integers(0, 4), st.integers(0, 4), st.integers(0, 3),
       st.sampled_from([np.dtype(t) for t in (np.uint8, np.int64, np.float16, np.float32,
                                              np.float64)]))
def test_matmul_batched_against_numpy(data, n, k, m, nbatch, dtype):
    batch_a = tuple(data.draw(st.lists(st.sampled_from([0, 1, 2, 3]), min_size=nbatch,
                                       max_size=nbatch)))
    batch_b = tuple(1 if (data.draw(st.booleans()) and b != 1) else b for b in batch_a)
    ta, xa = data.draw(tensor_and_array(dtype, batch_a + (n, k)))
    tb, xb = data.draw(tensor_and_array(dtype, batch_b[data.draw(st.integers(0, nbatch)):]
                                        + (k, m)))
    # float16 through float32 (the product's accumulation is not numpy's); the tolerance
    # scales with the magnitude of the k-term dot products
    wide = np.float32 if dtype.itemsize == 2 else dtype
    scale = float(k) * 100 if dtype.kind == "f" else 1.0
    assert_matches(ta @ tb, np.matmul(xa.astype(wide), xb.astype(wide)), dtype, scale)


@SETTINGS
@given(st.data(), hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=4),
       st.sampled_from(DTYPES), st.sampled_from(DTYPES), st.integers(1, 3))
def test_cat_against_numpy(data, shape, d1, d2, n):
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    pieces = []
    for i in range(n):
        s = list(shape)
        s[dim] = data.draw(st.integers(0, 3))
        pieces.append(data.draw(tensor_and_array(d1 if i % 2 == 0 else d2, tuple(s))))
    rt = torch_promote(d1, d2) if n > 1 else d1
    expected = np.concatenate([x.astype(rt) for _, x in pieces], axis=dim)
    assert_matches(dt.cat([t for t, _ in pieces], dim), expected, rt)


@SETTINGS
@given(st.data(), hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=4),
       st.sampled_from(FLOATS))
def test_inplace_add_writes_through_views(data, shape, dtype):
    # self is a view (permuted, stepped or negative-stride) of a stored buffer: exactly its
    # elements change.
    stored, view = data.draw(stored_view(dtype, shape, writable=True))
    k = data.draw(st.integers(0, len(shape)))
    other_shape = tuple(1 if data.draw(st.booleans()) else n for n in shape[k:])
    u, y = data.draw(tensor_and_array(dtype, other_shape))
    expected = stored.copy()
    view(expected)[...] += y
    t = view(dt.from_numpy(stored))
    assert t.add_(u) is t
    assert_matches(dt.from_numpy(stored), expected, dtype)
    t.mul_(2.0)
    view(expected)[...] *= 2
    assert_matches(dt.from_numpy(stored), expected, dtype)


@FEW
@given(st.data(), hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=4),
       st.sampled_from(FLOATS))
def test_inplace_into_an_expanded_tensor_raises(data, shape, dtype):
    # PyTorch refuses to write through a stride-0 dim that repeats an element; nothing is
    # written. Size-1 and size-0 expanded dims repeat nothing: the write goes through (to
    # every stored element, or to none when the view has no elements).
    small = tuple(1 if data.draw(st.booleans()) else n for n in shape)
    stored = data.draw(arrays(dtype, small))
    before = stored.copy()
    t = dt.from_numpy(stored).expand(*shape)
    repeats = math.prod(shape) > 0 and any(n > 1 and s == 1 for n, s in zip(shape, small))
    if repeats:
        with pytest.raises(ViewError, match="more than one element"):
            t.add_(1.0)
        np.testing.assert_array_equal(stored, before)
    else:
        t.add_(1.0)
        expected = before + dtype.type(1) if math.prod(shape) else before
        assert_matches(dt.from_numpy(stored), expected, dtype)
