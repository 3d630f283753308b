"""The compiled stride math (``fastpath._strides``) against its reference ``dtensor.local.strides``.

Every function must give the same result, or raise the same error with the same message,
on random inputs; views it declares possible are also checked against numpy's reshape.
These tests skip when the extension was not built, unless ``DTENSOR_REQUIRE_EXT=1``
(set by CI), which turns a missing extension into a failure.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import fastpath
import placements.meta
from dtensor.errors import ViewError
from dtensor.local import strides as ref

needs_ext = pytest.mark.skipif(
    not fastpath.AVAILABLE, reason=f"fastpath extension not built: {fastpath.IMPORT_ERROR}"
)
fast = fastpath.strides

sizes_st = st.lists(st.integers(0, 5), max_size=5).map(tuple)
stride_value_st = st.integers(-40, 40)


def _outcome(fn, *args):
    """The function's result, or the type and message of what it raised."""
    try:
        return ("ok", fn(*args))
    except Exception as exc:  # noqa: BLE001 - the error itself is what is compared
        return ("raised", type(exc), str(exc))


@st.composite
def sizes_and_strides(draw):
    """Sizes with strides that are random, or of a permuted/stepped contiguous layout."""
    sizes = draw(sizes_st)
    n = len(sizes)
    kind = draw(st.sampled_from(["random", "layout"]))
    if kind == "random":
        strides = tuple(draw(st.lists(stride_value_st, min_size=n, max_size=n)))
    else:
        order = draw(st.permutations(range(n)))
        steps = draw(st.lists(st.integers(1, 3), min_size=n, max_size=n))
        dense = ref.contiguous_strides(tuple(sizes[d] for d in order))
        strides = [0] * n
        for pos, d in enumerate(order):
            strides[d] = dense[pos] * steps[d]
        strides = tuple(strides)
    return sizes, strides


@st.composite
def same_numel_sizes(draw, numel):
    """Sizes holding ``numel`` elements: a random factorisation with 1s sprinkled in."""
    if numel == 0:
        dims = draw(st.lists(st.integers(0, 4), min_size=1, max_size=4))
        dims[draw(st.integers(0, len(dims) - 1))] = 0
        return tuple(dims)
    dims, rest = [], numel
    while rest > 1:
        factor = draw(st.sampled_from([f for f in range(2, rest + 1) if rest % f == 0]))
        dims.append(factor)
        rest //= factor
    for _ in range(draw(st.integers(0, 2))):
        dims.insert(draw(st.integers(0, len(dims))), 1)
    return tuple(draw(st.permutations(dims)))


def test_extension_is_built_when_required():
    if os.environ.get("DTENSOR_REQUIRE_EXT") != "1":
        pytest.skip("DTENSOR_REQUIRE_EXT is not 1")
    assert fastpath.AVAILABLE, f"fastpath extension not built: {fastpath.IMPORT_ERROR}"


def test_package_reports_the_extension():
    assert fastpath.AVAILABLE is (fastpath.strides is not None)
    assert (fastpath.IMPORT_ERROR is None) is fastpath.AVAILABLE


@needs_ext
@given(sizes_st)
def test_contiguous_strides(sizes):
    got = fast.contiguous_strides(sizes)
    assert got == ref.contiguous_strides(sizes)
    assert all(type(v) is int for v in got)
    if 0 not in sizes:
        itemsize = np.dtype(np.float64).itemsize
        assert got == tuple(s // itemsize for s in np.empty(sizes).strides)


@needs_ext
@given(sizes_and_strides(), st.data())
def test_is_contiguous(layout, data):
    sizes, strides = layout
    assert fast.is_contiguous(sizes, strides) is ref.is_contiguous(sizes, strides)
    # Contiguous strides stay contiguous whatever the strides of size-1 dims are.
    dense = list(ref.contiguous_strides(sizes))
    for d, size in enumerate(sizes):
        if size == 1:
            dense[d] = data.draw(stride_value_st)
    assert fast.is_contiguous(sizes, tuple(dense)) is True


@needs_ext
@given(sizes_and_strides(), st.data())
def test_compute_view_strides(layout, data):
    sizes, strides = layout
    new_sizes = data.draw(
        st.one_of(st.just(sizes), same_numel_sizes(math.prod(sizes))), label="new_sizes"
    )
    got = fast.compute_view_strides(sizes, strides, new_sizes)
    assert got == ref.compute_view_strides(sizes, strides, new_sizes)
    if got is None or math.prod(sizes) == 0 or min(strides, default=0) < 0:
        return
    # A possible view addresses the same elements, in the same order, as numpy's reshape.
    span = 1 + sum((s - 1) * st_ for s, st_ in zip(sizes, strides))
    buf = np.arange(max(span, 1))
    item = buf.itemsize
    old = np.lib.stride_tricks.as_strided(buf, sizes, [s * item for s in strides])
    new = np.lib.stride_tricks.as_strided(buf, new_sizes, [s * item for s in got])
    np.testing.assert_array_equal(new, old.reshape(new_sizes))


@needs_ext
def test_compute_view_strides_pinned():
    # torch.arange(24).view(2, 3, 4): merging contiguous dims is a view.
    assert fast.compute_view_strides((2, 3, 4), (12, 4, 1), (6, 4)) == (4, 1)
    # The transpose of a (3, 4) tensor cannot be flattened without a copy.
    assert fast.compute_view_strides((4, 3), (1, 4), (12,)) is None
    # Size-1 dims are free; a 0-dim tensor views as all-ones strides.
    assert fast.compute_view_strides((4, 1, 3), (1, 99, 4), (4, 3)) == (1, 4)
    assert fast.compute_view_strides((), (), (1, 1)) == (1, 1)
    # Zero elements: same sizes keep the strides, other sizes get contiguous strides.
    assert fast.compute_view_strides((2, 0), (7, 3), (2, 0)) == (7, 3)
    assert fast.compute_view_strides((2, 0), (7, 3), (0, 3, 2)) == (6, 2, 1)


@needs_ext
@given(
    st.lists(st.sampled_from([-2, -1, -1, 0, 1, 2, 3, 4, 6]), max_size=4).map(tuple),
    st.integers(0, 60),
)
def test_infer_size(shape, numel):
    assert _outcome(fast.infer_size, shape, numel) == _outcome(ref.infer_size, shape, numel)


@needs_ext
def test_infer_size_messages():
    assert fast.infer_size((-1, 4), 8) == (2, 4)
    cases = {
        ((3, 5), 8): "shape '[3, 5]' is invalid for input of size 8",
        ((-1, -1), 8): "only one dimension can be inferred",
        ((-2, 4), 8): "invalid shape dimension -2",
        ((-1, 0), 0): "cannot reshape tensor of 0 elements into shape [-1, 0] because the "
        "unspecified dimension size -1 can be any value and is ambiguous",
    }
    for (shape, numel), message in cases.items():
        with pytest.raises(ViewError) as info:
            fast.infer_size(shape, numel)
        assert str(info.value) == message


@needs_ext
@pytest.mark.parametrize(
    "shape, numel",
    [
        ((2, 1.5), 3),  # not an int: meta's DTypeError
        ((-2, "a"), 3),  # every size is checked to be an int first, as in meta
        ((True, 3), 3),  # a bool is read as an int (1)
        ((np.int64(2), -1), 6),
        ((2, 2**70), 3),  # beyond 64 bits
        ((2**40, 2**40, 0), 0),  # a product beyond 64 bits
        ((2**40, 2**40), 0),
        ((-1, -1, 2**70), 8),
    ],
)
def test_infer_size_outside_int64_ints_is_meta(shape, numel):
    """Sizes the compiled loop does not take go to placements.meta: same results, errors."""
    assert _outcome(fast.infer_size, shape, numel) == _outcome(ref.infer_size, shape, numel)
    assert ref.infer_size is placements.meta.infer_size


@needs_ext
def test_sequences_other_than_tuples():
    assert fast.contiguous_strides([2, 3]) == (3, 1)
    assert fast.is_contiguous([2, 3], [3, 1]) is True
    assert fast.compute_view_strides([2, 3], [3, 1], [6]) == (1,)
    assert fast.infer_size([np.int64(2), -1], 6) == (2, 3)


@needs_ext
def test_mismatched_lengths_raise():
    with pytest.raises(ValueError, match="different lengths"):
        fast.is_contiguous((2, 3), (1,))
    with pytest.raises(ValueError, match="different lengths"):
        fast.compute_view_strides((2, 3), (1,), (6,))
