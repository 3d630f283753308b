"""Property tests of the local Tensor.

* Random chains of view ops on a tensor give the values of the same ops on a numpy
  array, share the root's storage, and report strides/offsets that describe the memory
  (re-viewing the storage with them gives the same values).
* For the simple view ops the strides and offsets also follow PyTorch's formulas
  (transpose/permute swap strides, narrow/select move the offset by start * stride,
  unsqueeze inserts size * stride, expand gives stride 0).
* view/reshape agree with PyTorch's computeStride on random strided inputs.
* Random blocks equal the matching slice of the whole random tensor.

Roots are contiguous or negative-stride numpy views (of int32, uint8, float16 or float64
values, NaN and infinities among the floats) given to ``from_numpy``; chains include
size-0 dims and stride-0 (expand) dims. Example counts scale with the hypothesis profile
(``HYPOTHESIS_PROFILE``, see ``tests/conftest.py``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dtensor as dt
from dtensor.errors import ViewError
from dtensor.local import rng as _random
from dtensor.local import strides as S

shapes = st.lists(st.integers(0, 4), min_size=0, max_size=4).map(tuple)
DTYPES = [np.dtype(t) for t in (np.int32, np.uint8, np.float16, np.float64)]
#: A value no root holds (uint8 roots count modulo 255).
SENTINEL = {"i": -7, "u": 255, "f": -7}
#: The view-chain test draws several ops per example: twice the profile's examples.
MANY = settings(max_examples=settings.default.max_examples * 2)
#: The other tests: 1.25 times.
SOME = settings(max_examples=settings.default.max_examples * 5 // 4)


def check_memory(t, root):
    """t's metadata describes its memory, and t lives in root's storage."""
    assert t.untyped_storage().data_ptr() == root.untyped_storage().data_ptr()
    assert t.untyped_storage().nbytes() == root.untyped_storage().nbytes()
    again = t.as_strided(t.shape, t.stride(), t.storage_offset())
    np.testing.assert_array_equal(again.numpy(), t.numpy())
    assert t.is_contiguous() == S.is_contiguous(tuple(t.shape), t.stride())


def factor_shapes(n):
    """Shapes with n elements (n > 0): random factorisations with 1s sprinkled in."""
    divisors = [d for d in range(1, n + 1) if n % d == 0]

    @st.composite
    def build(draw):
        dims, rest = [], n
        while rest > 1 and len(dims) < 4:
            d = draw(st.sampled_from([x for x in divisors if rest % x == 0 and x > 1]))
            dims.append(d)
            rest //= d
        if rest > 1:
            dims.append(rest)
        for _ in range(draw(st.integers(0, 2))):
            dims.insert(draw(st.integers(0, len(dims))), 1)
        return tuple(draw(st.permutations(dims)))

    return build()


def new_shape_for(draw, shape):
    n = math.prod(shape)
    if n == 0:
        dims = list(draw(st.lists(st.integers(0, 3), min_size=1, max_size=3)))
        dims[draw(st.integers(0, len(dims) - 1))] = 0
        return tuple(dims)
    new = list(draw(factor_shapes(n)))
    if new and draw(st.booleans()):
        new[draw(st.integers(0, len(new) - 1))] = -1
    return tuple(new)


def step(draw, t, a):
    """Apply one random view op to tensor t and array a; returns (t, a, predicted, name).

    ``predicted`` is (shape, strides, offset) by PyTorch's formulas applied to t's
    metadata, or None when the op has no simple formula. ``name`` is "copy" when the op
    legitimately copied (reshape/flatten without a possible view).
    """
    nd = t.ndim
    shape, strides, offset = tuple(t.shape), t.stride(), t.storage_offset()
    ops = ["unsqueeze", "getitem", "expand", "view", "reshape", "flatten"]
    if nd:
        ops += [
            "narrow",
            "select",
            "squeeze_dim",
            "permute",
            "transpose",
            "movedim",
            "split",
            "chunk",
            "unflatten",
            "squeeze",
        ]
    if nd <= 2:
        ops.append("t")
    op = draw(st.sampled_from(ops))
    predicted = None
    if op == "transpose":
        d0, d1 = draw(st.integers(-nd, nd - 1)), draw(st.integers(-nd, nd - 1))
        t, a = t.transpose(d0, d1), np.swapaxes(a, d0, d1)
        sz, sd = list(shape), list(strides)
        sz[d0], sz[d1], sd[d0], sd[d1] = sz[d1], sz[d0], sd[d1], sd[d0]
        predicted = (tuple(sz), tuple(sd), offset)
    elif op == "permute":
        perm = draw(st.permutations(range(nd)))
        t, a = t.permute(*perm), a.transpose(perm)
        predicted = (tuple(shape[p] for p in perm), tuple(strides[p] for p in perm), offset)
    elif op == "movedim":
        src, dst = draw(st.integers(0, nd - 1)), draw(st.integers(0, nd - 1))
        t, a = t.movedim(src, dst), np.moveaxis(a, src, dst)
    elif op == "t":
        t, a = t.t(), a.T
        predicted = (shape[::-1], strides[::-1], offset)
    elif op == "narrow":
        d = draw(st.integers(0, nd - 1))
        start = draw(st.integers(0, shape[d]))
        length = draw(st.integers(0, shape[d] - start))
        t = t.narrow(d, start, length)
        a = a[(slice(None),) * d + (slice(start, start + length),)]
        predicted = (shape[:d] + (length,) + shape[d + 1 :], strides, offset + start * strides[d])
    elif op == "select":
        d = draw(st.integers(0, nd - 1))
        if shape[d] == 0:
            return t, a, None, "noop"
        i = draw(st.integers(-shape[d], shape[d] - 1))
        t, a = t.select(d, i), a[(slice(None),) * d + (i,)]
        predicted = (
            shape[:d] + shape[d + 1 :],
            strides[:d] + strides[d + 1 :],
            offset + (i % shape[d]) * strides[d],
        )
    elif op == "unsqueeze":
        d = draw(st.integers(-nd - 1, nd))
        t, a = t.unsqueeze(d), np.expand_dims(a, d)
        p = d % (nd + 1)
        inserted = shape[p] * strides[p] if p < nd else 1
        predicted = (shape[:p] + (1,) + shape[p:], strides[:p] + (inserted,) + strides[p:], offset)
    elif op == "squeeze":
        t, a = t.squeeze(), np.squeeze(a)
        keep = [i for i in range(nd) if shape[i] != 1]
        predicted = (tuple(shape[i] for i in keep), tuple(strides[i] for i in keep), offset)
    elif op == "squeeze_dim":
        d = draw(st.integers(-nd, nd - 1))
        p = d % nd
        t = t.squeeze(d)
        if shape[p] == 1:
            a = np.squeeze(a, p)
            predicted = (shape[:p] + shape[p + 1 :], strides[:p] + strides[p + 1 :], offset)
        else:
            predicted = (shape, strides, offset)
    elif op == "expand":
        lead = tuple(draw(st.lists(st.integers(0, 3), max_size=2)))
        target = [draw(st.sampled_from([-1, 2, 3] if s == 1 else [-1, s])) for s in shape]
        t = t.expand(*lead, *target)
        body = tuple(s if g == -1 else g for s, g in zip(shape, target))
        a = np.broadcast_to(a, lead + body)
        if not lead:
            predicted = (
                body,
                tuple(0 if s != g else r for s, g, r in zip(shape, body, strides)),
                offset,
            )
    elif op == "getitem":
        idx = []
        for size in shape:
            kind = draw(st.sampled_from(["int", "slice", "all", "none"]))
            if kind == "int" and size:
                idx.append(draw(st.integers(-size, size - 1)))
            elif kind == "slice":
                idx.append(
                    slice(
                        draw(st.integers(-5, 5)), draw(st.integers(-5, 5)), draw(st.integers(1, 3))
                    )
                )
            elif kind == "none":
                idx += [None, slice(None)]
            else:
                idx.append(slice(None))
        if idx and draw(st.booleans()):
            idx[draw(st.integers(0, len(idx) - 1))] = Ellipsis
        idx = tuple(idx[: draw(st.integers(0, len(idx)))])
        try:
            expected = a[idx]
        except IndexError:  # an int that the Ellipsis moved onto an empty dim
            with pytest.raises(IndexError):
                t[idx]
            return t, a, None, "noop"
        t, a = t[idx], expected
    elif op in ("view", "reshape"):
        new = new_shape_for(draw, shape)
        inferred = S.infer_size(new, math.prod(shape))
        expected = S.compute_view_strides(shape, strides, inferred)
        a = a.reshape(inferred)
        if op == "view" and expected is None:
            with pytest.raises(ViewError, match="view size is not compatible"):
                t.view(new)
            return t, a.reshape(shape), None, "noop"
        t = t.view(new) if op == "view" else t.reshape(new)
        if expected is None:
            return t, a, None, "copy"
        predicted = (inferred, expected, offset)
    elif op == "flatten":
        s = draw(st.integers(0, max(nd - 1, 0)))
        e = draw(st.integers(s, max(nd - 1, 0)))
        new = shape[:s] + (math.prod(shape[s : e + 1]),) + shape[e + 1 :] if nd else (1,)
        viewable = S.compute_view_strides(shape, strides, new) is not None
        t, a = t.flatten(s, e), a.reshape(new)
        if not viewable:
            return t, a, None, "copy"
    elif op == "unflatten":
        d = draw(st.integers(0, nd - 1))
        if shape[d] == 0:
            return t, a, None, "noop"
        sizes = draw(factor_shapes(shape[d])) or (1,)
        t = t.unflatten(d, sizes)
        a = a.reshape(shape[:d] + sizes + shape[d + 1 :])
    elif op in ("split", "chunk"):
        d = draw(st.integers(0, nd - 1))
        n = draw(st.integers(1, 3))
        pieces = t.split(n, d) if op == "split" else t.chunk(n, d)
        size = shape[d]
        piece = n if op == "split" else -(-size // n)
        ref = np.array_split(a, range(piece, size, piece), axis=d) if size else [a] * len(pieces)
        assert len(pieces) == len(ref)
        k = draw(st.integers(0, len(pieces) - 1))
        t, a = pieces[k], ref[k]
    return t, a, predicted, op


def addressed(t):
    """Storage positions (in elements) of every element of t."""
    pos = np.full(tuple(t.shape), t.storage_offset(), dtype=np.int64)
    for d, stride in enumerate(t.stride()):
        shape = [1] * t.ndim
        shape[d] = t.shape[d]
        pos = pos + (np.arange(t.shape[d]) * stride).reshape(shape)
    return pos


def root_values(draw, shape, dtype):
    """Distinct-ish values of ``shape``: a count (modulo 255 for uint8), a few floats set to
    NaN or infinity."""
    n = math.prod(shape)
    values = (np.arange(n) % 255 if dtype.kind == "u" else np.arange(n)).astype(dtype)
    if dtype.kind == "f" and n and draw(st.booleans()):
        for i in draw(st.lists(st.integers(0, n - 1), max_size=3)):
            values[i] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    return values.reshape(shape)


@MANY
@given(shape=shapes, dtype=st.sampled_from(DTYPES), data=st.data())
def test_random_view_chains_match_numpy_and_share_memory(shape, dtype, data):
    # the root: the whole stored array, or a view of it with negative steps on some dims
    steps = tuple(data.draw(st.sampled_from([1, 1, -1, -2])) for _ in shape)
    stored = root_values(data.draw, tuple(n * abs(s) for n, s in zip(shape, steps)), dtype)
    base = stored[(*(slice(None, None, s) for s in steps), Ellipsis)]
    root = dt.from_numpy(base)
    t, a = root, base.copy()
    copied = False
    for _ in range(data.draw(st.integers(1, 6))):
        t, a, predicted, op = step(data.draw, t, a)
        assert tuple(t.shape) == a.shape, op
        np.testing.assert_array_equal(t.numpy(), a, err_msg=op)
        copied = copied or op == "copy"
        if copied:
            continue
        check_memory(t, root)
        if predicted is not None:
            nbytes = t.untyped_storage().nbytes()
            if t.numel() == 0 and not 0 <= predicted[2] * dtype.itemsize <= nbytes:
                # an empty view cannot point outside its storage; it keeps its parent's offset
                predicted = predicted[:2] + (t.storage_offset(),)
            assert (tuple(t.shape), t.stride(), t.storage_offset()) == predicted, op
    expanded = any(s == 0 and n > 1 for n, s in zip(t.shape, t.stride()))
    if not copied and not expanded:
        # a write through the final view lands exactly on the storage positions it names
        pos = addressed(t)
        sentinel = SENTINEL[dtype.kind]
        t.fill_(sentinel)
        flat = stored.reshape(-1)
        assert (flat[pos] == dtype.type(sentinel)).all()
        assert (flat == dtype.type(sentinel)).sum() == np.unique(pos).size


@SOME
@given(shape=st.lists(st.integers(0, 4), min_size=1, max_size=4).map(tuple), data=st.data())
def test_view_and_reshape_follow_compute_stride(shape, data):
    # permuted, stepped (negative steps through numpy: Tensor indexing takes none) and
    # expanded (stride 0) inputs
    base = dt.arange(math.prod(shape), dtype=dt.float64).view(shape)
    perm = data.draw(st.permutations(range(len(shape))))
    steps = [data.draw(st.sampled_from([1, 2, -1, -2])) for _ in shape]
    index = (*(slice(None, None, s) for s in steps), Ellipsis)
    t = base.permute(*perm)
    t = dt.from_numpy(t.numpy()[index]) if min(steps) < 0 else t[index]
    a = np.arange(math.prod(shape), dtype=np.float64).reshape(shape).transpose(perm)[index]
    if data.draw(st.booleans()):  # a new stride-0 dim
        d, n = data.draw(st.integers(0, a.ndim)), data.draw(st.integers(0, 3))
        t = t.unsqueeze(d).expand(*a.shape[:d], n, *a.shape[d:])
        a = np.broadcast_to(np.expand_dims(a, d), t.shape)
    new = new_shape_for(data.draw, a.shape)
    expected = S.compute_view_strides(tuple(t.shape), t.stride(), S.infer_size(new, a.size))
    r = t.reshape(new)
    np.testing.assert_array_equal(r.numpy(), a.reshape(new))
    shares = r.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    assert shares == (expected is not None)
    if expected is None:
        with pytest.raises(ViewError):
            t.view(new)
        assert r.is_contiguous()
    else:
        v = t.view(new)
        assert v.stride() == expected and v.storage_offset() == t.storage_offset()
        np.testing.assert_array_equal(v.numpy(), a.reshape(new))


@SOME
@given(shape=shapes, dtype=st.sampled_from(DTYPES), data=st.data())
def test_from_numpy_of_random_strided_views_is_zero_copy(shape, dtype, data):
    base = root_values(data.draw, shape, dtype)
    idx = tuple(slice(None, None, data.draw(st.sampled_from([1, 2, -1, -2]))) for _ in shape)
    perm = data.draw(st.permutations(range(len(shape))))
    a = base[(*idx, Ellipsis)].transpose(perm)
    t = dt.from_numpy(a)
    np.testing.assert_array_equal(t.numpy(), a)
    assert t.untyped_storage().nbytes() == base.nbytes
    assert t.untyped_storage().data_ptr() == base.__array_interface__["data"][0]
    assert t.stride() == tuple(s // dtype.itemsize for s in a.strides)
    check_memory(t, dt.from_numpy(base))
    if a.size:
        t.view(np.dtype(f"i{dtype.itemsize}")).fill_(0)  # the same bytes, reinterpreted
        assert (a == 0).all()
    # stride 0: a broadcast numpy array stays a view; writes through it are refused
    lead = data.draw(st.integers(0, 2))
    b = np.broadcast_to(a, (lead,) * bool(lead) + a.shape)
    u = dt.from_numpy(b)
    assert u.stride() == tuple(s // dtype.itemsize for s in b.strides)
    np.testing.assert_array_equal(u.numpy(), b)
    if lead > 1 and a.size:
        with pytest.raises(ViewError, match="more than one element"):
            u.fill_(1)


@SOME
@given(
    shape=st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple),
    data=st.data(),
    kind=st.sampled_from(["uniform", "normal", "randint"]),
    seed=st.integers(0, 2**64 - 1),
    offset=st.integers(0, 2**64 - 1),
)
def test_random_blocks_equal_slices_of_the_whole(shape, data, kind, seed, offset):
    dtype = (
        np.int64
        if kind == "randint"
        else data.draw(st.sampled_from([np.float16, np.float32, np.float64]))
    )
    whole = _random.random_block(
        kind, shape, (0,) * len(shape), shape, dtype, seed, offset, np, low=-100, high=100
    )
    starts = tuple(data.draw(st.integers(0, n)) for n in shape)
    sizes = tuple(data.draw(st.integers(0, n - s)) for n, s in zip(shape, starts))
    block = _random.random_block(
        kind, shape, starts, sizes, dtype, seed, offset, np, low=-100, high=100
    )
    np.testing.assert_array_equal(
        block, whole[tuple(slice(s, s + n) for s, n in zip(starts, sizes))]
    )
    if kind == "uniform":
        assert ((whole >= 0) & (whole < 1)).all()
    if kind == "randint":
        assert ((whole >= -100) & (whole < 100)).all()
