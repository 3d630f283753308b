"""Property tests of the local math kernels: random shapes, broadcasts, dtypes, memory
layouts, python scalars and reduction dims, compared with numpy.

Expected dtypes come from PyTorch's promotion rule, written here independently of the
library: among tensors, the higher category (bool < integer < floating) wins and within a
category the wider dtype; a python scalar only matters when its category is higher than
the tensor's (int -> int64, float -> the default float dtype, float32); a 0-d tensor beside
a dimensioned one acts the same way with its own dtype.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import dtensor as dt
from dtensor.errors import DTypeError

DTYPES = [np.dtype(t) for t in (np.bool_, np.int32, np.int64, np.float32, np.float64)]
CAT = {"b": 0, "i": 1, "u": 1, "f": 2}
SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])

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
    if dtype.kind == "i":
        return st.integers(-20, 20)
    return st.floats(-10, 10, width=32 if dtype.itemsize == 4 else 64)


@st.composite
def stored_view(draw, dtype, shape):
    """A stored array and a function giving the view of ``shape`` on it (or on a Tensor of
    it): contiguous, permuted or stepped."""
    layout = draw(st.sampled_from(["contiguous", "permuted", "stepped"]))
    if layout == "permuted" and len(shape) > 1:
        perm = draw(st.permutations(range(len(shape))))
        inv = tuple(int(i) for i in np.argsort(perm))
        stored = draw(hnp.arrays(dtype, tuple(shape[p] for p in perm), elements=elements(dtype)))

        def view(a):
            return a.permute(*inv) if isinstance(a, dt.Tensor) else a.transpose(inv)

        return stored, view
    if layout == "stepped" and shape:
        big = (shape[0] * 2,) + tuple(shape[1:])
        return draw(hnp.arrays(dtype, big, elements=elements(dtype))), lambda a: a[::2]
    return draw(hnp.arrays(dtype, tuple(shape), elements=elements(dtype))), lambda a: a


@st.composite
def tensor_and_array(draw, dtype, shape):
    """A Tensor of ``shape`` (possibly a permuted or stepped view) and its numpy values."""
    stored, view = draw(stored_view(dtype, shape))
    return view(dt.from_numpy(stored)), view(stored)


def assert_matches(t, expected, dtype):
    assert t.dtype == dtype, (t.dtype, dtype)
    got = np.asarray(t.numpy())
    assert got.shape == np.shape(expected)
    if dtype.kind == "f":
        tol = 1e-5 if dtype.itemsize == 4 else 1e-12
        np.testing.assert_allclose(got, np.asarray(expected, dtype), rtol=tol, atol=tol,
                                   equal_nan=True)
    else:
        np.testing.assert_array_equal(got, expected)


ARITH = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "maximum": np.maximum,
         "minimum": np.minimum, "floor_divide": np.floor_divide, "remainder": np.remainder}
COMPARE = {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal,
           "gt": np.greater, "ge": np.greater_equal}
DIVISION = {"floor_divide", "remainder"}


@SETTINGS
@given(st.data(), hnp.mutually_broadcastable_shapes(num_shapes=2, max_dims=4, max_side=4),
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


@SETTINGS
@given(st.data(), hnp.array_shapes(min_dims=0, max_dims=3, max_side=4), st.sampled_from(DTYPES),
       st.one_of(st.booleans(), st.integers(-5, 5), st.floats(-4, 4)),
       st.sampled_from(["add", "sub", "mul", "maximum", "lt", "ge"]), st.booleans())
def test_python_scalars_both_sides(data, shape, dtype, scalar, name, scalar_first):
    t, x = data.draw(tensor_and_array(dtype, shape))
    rt = scalar_promote(dtype, scalar)
    args = (scalar, t) if scalar_first else (t, scalar)
    if name == "sub" and rt.kind == "b":
        with pytest.raises(DTypeError):
            getattr(dt, name)(*args)
        return
    xs = (np.asarray(scalar).astype(rt), x.astype(rt))
    ref = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "maximum": np.maximum,
           **COMPARE}[name](*(xs if scalar_first else xs[::-1]))
    expected_dtype = np.dtype(bool) if name in COMPARE else rt
    assert_matches(getattr(dt, name)(*args), ref, expected_dtype)
    if name in ("add", "sub", "mul", "lt", "ge"):
        op = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
              "lt": lambda a, b: a < b, "ge": lambda a, b: a >= b}[name]
        assert_matches(op(*args), ref, expected_dtype)


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
       st.sampled_from(["sum", "prod", "mean", "amax", "any", "all", "std"]))
def test_reductions_against_numpy(data, case, dtype, name):
    shape, dim, keepdim = case
    t, x = data.draw(tensor_and_array(dtype, shape))
    axes = _axes(dim, len(shape))
    if name in ("sum", "prod"):
        rt = np.dtype(np.int64) if dtype.kind in "biu" else dtype
        ref = getattr(np, name)(x, axis=axes, dtype=rt, keepdims=keepdim)
        assert_matches(getattr(dt, name)(t, dim, keepdim), ref, rt)
    elif name in ("mean", "std"):
        if dtype.kind != "f":
            with pytest.raises(DTypeError):
                getattr(dt, name)(t, dim, keepdim)
            return
        kw = {"ddof": 1} if name == "std" else {}
        ref = getattr(np, name)(x.astype(np.float64), axis=axes, keepdims=keepdim, **kw)
        assert_matches(getattr(dt, name)(t, dim, keepdim=keepdim), ref, dtype)
    elif name == "amax":
        n_reduced = x.size if axes is None else int(np.prod([x.shape[a] for a in axes]))
        assume(n_reduced > 0)
        ref = np.amax(x, axis=axes, keepdims=keepdim)
        assert_matches(dt.amax(t, () if dim is None else dim, keepdim), ref, dtype)
    else:
        ref = getattr(np, name)(x, axis=axes, keepdims=keepdim)
        assert_matches(getattr(dt, name)(t, dim, keepdim), ref, np.dtype(bool))


@SETTINGS
@given(st.data(), hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=5),
       st.sampled_from([np.dtype(np.int64), np.dtype(np.float64)]), st.booleans())
def test_max_with_dim_and_argmax_first_occurrence(data, shape, dtype, keepdim):
    # Small integer ranges make ties frequent: indices must be the first occurrence.
    t, x = data.draw(tensor_and_array(dtype, shape))
    x = np.asarray(x)
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    values, indices = dt.max(t, dim, keepdim)
    assert_matches(values, np.max(x, axis=dim, keepdims=keepdim), dtype)
    assert_matches(indices, np.argmax(x, axis=dim, keepdims=keepdim), np.dtype(np.int64))
    assert_matches(dt.argmin(t, dim, keepdim), np.argmin(x, axis=dim, keepdims=keepdim),
                   np.dtype(np.int64))


@SETTINGS
@given(st.data(), st.integers(1, 4), st.integers(0, 4), st.integers(1, 4), st.integers(0, 3),
       st.sampled_from([np.dtype(np.float64), np.dtype(np.int64)]))
def test_matmul_batched_against_numpy(data, n, k, m, nbatch, dtype):
    batch_a = tuple(data.draw(st.lists(st.sampled_from([1, 2, 3]), min_size=nbatch,
                                       max_size=nbatch)))
    batch_b = tuple(1 if (data.draw(st.booleans()) and b != 1) else b for b in batch_a)
    ta, xa = data.draw(tensor_and_array(dtype, batch_a + (n, k)))
    tb, xb = data.draw(tensor_and_array(dtype, batch_b[data.draw(st.integers(0, nbatch)):]
                                        + (k, m)))
    assert_matches(ta @ tb, np.matmul(xa, xb), dtype)


@SETTINGS
@given(st.data(), hnp.array_shapes(min_dims=1, max_dims=3, max_side=4),
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
@given(st.data(), hnp.array_shapes(min_dims=1, max_dims=3, max_side=4),
       st.sampled_from([np.dtype(np.float32), np.dtype(np.float64)]))
def test_inplace_add_writes_through_views(data, shape, dtype):
    # self is a view (permuted or stepped) of a stored buffer: exactly its elements change.
    stored, view = data.draw(stored_view(dtype, shape))
    k = data.draw(st.integers(0, len(shape)))
    other_shape = tuple(1 if data.draw(st.booleans()) else n for n in shape[k:])
    u, y = data.draw(tensor_and_array(dtype, other_shape))
    expected = stored.copy()
    view(expected)[...] += y
    t = view(dt.from_numpy(stored))
    assert t.add_(u) is t
    np.testing.assert_allclose(stored, expected, rtol=1e-6)
    t.mul_(2.0)
    view(expected)[...] *= 2
    np.testing.assert_allclose(stored, expected, rtol=1e-6)


@pytest.mark.parametrize("name", ["max", "min", "argmax", "argmin"])
def test_max_min_over_an_empty_dim_name_the_op(name):
    # found by the property test above: max/min over a size-0 dim raised naming argmax
    with pytest.raises(ValueError, match=rf"^{name}\(\): expected reduction dim"):
        getattr(dt, name)(dt.zeros(2, 0), 1)
