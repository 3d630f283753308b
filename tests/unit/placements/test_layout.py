"""Shard layout math: torch.chunk splits, nested order, stitching shards back together."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from placements import (
    Partial,
    Replicate,
    Shard,
    local_offsets,
    local_shape,
    local_slices,
    max_local_shape,
    normalize_placements,
    shard_range,
)
from placements.errors import MeshError, PlacementError, ShardingError

pytestmark = pytest.mark.mode_independent  # see tests/conftest.py

MESHES = [(2,), (3,), (4,), (2, 2), (2, 3), (2, 2, 2)]


def torch_chunk_sizes(n: int, k: int) -> list[int]:
    """Reference: torch.chunk's pieces (slices of ceil(n/k) taken until the end), padded with
    empty pieces to k, as DTensor does."""
    chunk = -(-n // k)
    items = list(range(n))
    pieces = [items[i : i + chunk] for i in range(0, n, chunk)] if chunk else []
    return [len(p) for p in pieces] + [0] * (k - len(pieces))


@pytest.mark.parametrize(
    ("n", "k", "sizes"),
    [
        (5, 4, [2, 2, 1, 0]),
        (8, 3, [3, 3, 2]),
        (6, 4, [2, 2, 2, 0]),
        (1, 4, [1, 0, 0, 0]),
        (0, 3, [0, 0, 0]),
        (7, 1, [7]),
        (4, 2, [2, 2]),
    ],
)
def test_shard_range_matches_torch_chunk_examples(n, k, sizes):
    assert [shard_range(n, k, i)[1] for i in range(k)] == sizes
    assert torch_chunk_sizes(n, k) == sizes


@given(n=st.integers(0, 300), k=st.integers(1, 17))
def test_shard_range_is_torch_chunk(n, k):
    ranges = [shard_range(n, k, i) for i in range(k)]
    assert [length for _, length in ranges] == torch_chunk_sizes(n, k)
    position = 0
    for start, length in ranges:  # contiguous, in order, covering [0, n)
        assert start == position
        position += length
    assert position == n


def test_shard_range_errors():
    with pytest.raises(MeshError):
        shard_range(5, 0, 0)
    with pytest.raises(MeshError):
        shard_range(5, 2, 2)
    with pytest.raises(MeshError):
        shard_range(5, 2, -1)
    with pytest.raises(ShardingError):
        shard_range(-1, 2, 0)


def test_nested_sharding_splits_mesh_dim_0_first():
    # 8 rows, [S(0), S(0)] on (2, 2): coordinate (i, j) holds rows 4i + 2j .. 4i + 2j + 2.
    for i, j in itertools.product(range(2), range(2)):
        assert local_slices((8, 3), (2, 2), [Shard(0), Shard(0)], (i, j)) == (
            slice(4 * i + 2 * j, 4 * i + 2 * j + 2),
            slice(0, 3),
        )
    # 7 rows on (2, 3): mesh dim 0 gives 4 and 3 rows; mesh dim 1 splits each into 3 chunks.
    starts_lengths = {
        c: (local_offsets((7,), (2, 3), [Shard(0), Shard(0)], c)[0],
            local_shape((7,), (2, 3), [Shard(0), Shard(0)], c)[0])
        for c in itertools.product(range(2), range(3))
    }
    assert starts_lengths == {
        (0, 0): (0, 2), (0, 1): (2, 2), (0, 2): (4, 0),
        (1, 0): (4, 1), (1, 1): (5, 1), (1, 2): (6, 1),
    }


def test_replicate_and_partial_do_not_split():
    for p in (Replicate(), Partial(), Partial("max")):
        for c in range(4):
            assert local_slices((5, 2), (4,), [p], (c,)) == (slice(0, 5), slice(0, 2))


def test_layout_errors():
    with pytest.raises(
        PlacementError,
        match=r"^Shard\(dim=3\) is out of range for a 2-D tensor of shape \(4, 6\) "
        r"\(placements \[S\(3\), R\]\)$",
    ):
        local_shape((4, 6), (2, 2), [Shard(3), Replicate()], (0, 0))
    with pytest.raises(PlacementError, match="need one per mesh dim"):
        local_shape((4, 6), (2, 2), [Shard(0)], (0, 0))
    with pytest.raises(MeshError, match=r"mesh coordinate \(2, 0\) is out of range"):
        local_shape((4, 6), (2, 2), [Shard(0), Replicate()], (2, 0))
    with pytest.raises(MeshError):
        local_offsets((4, 6), (2, 2), [Shard(0), Replicate()], (0,))
    with pytest.raises(ShardingError):
        local_slices((4, -6), (2,), [Shard(0)], (0,))
    assert normalize_placements([Shard(-1), Replicate()], (4, 6), (2, 2)) == (
        Shard(1),
        Replicate(),
    )


@st.composite
def layouts(draw):
    mesh_shape = draw(st.sampled_from(MESHES))
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=ndim, max_size=ndim)))
    options = [Shard(d) for d in range(ndim)] + [Shard(-1), Replicate(), Partial()]
    placements = draw(
        st.lists(st.sampled_from(options), min_size=len(mesh_shape), max_size=len(mesh_shape))
    )
    if draw(st.booleans()):  # often shard one tensor dim on every mesh dim (nested)
        d = draw(st.integers(0, ndim - 1))
        placements = [Shard(d) if draw(st.booleans()) else p for p in placements]
    return shape, mesh_shape, placements


def reference_blocks(index, mesh_shape, placements):
    """Recursive reference distribution of an array of global flat indices: mesh dim 0
    distributes first, each mesh dim splits what the previous ones left (torch.chunk)."""
    out = {}

    def rec(block, m, prefix):
        if m == len(mesh_shape):
            out[prefix] = block
            return
        p, k = placements[m], mesh_shape[m]
        if p.is_shard():
            axis = p.dim % block.ndim
            bounds = np.cumsum([0] + torch_chunk_sizes(block.shape[axis], k))
            pieces = [
                np.take(block, np.arange(bounds[i], bounds[i + 1]), axis=axis) for i in range(k)
            ]
        else:
            pieces = [block] * k
        for i, piece in enumerate(pieces):
            rec(piece, m + 1, prefix + (i,))

    rec(index, 0, ())
    return out


@given(layouts())
def test_local_blocks_stitch_back_to_the_global_array(layout):
    shape, mesh_shape, placements = layout
    index = np.arange(int(np.prod(shape))).reshape(shape)
    expected = reference_blocks(index, mesh_shape, placements)
    coverage = np.zeros(shape, dtype=np.int64)
    stitched = np.full(shape, -1)
    shard_dims = [m for m, p in enumerate(placements) if p.is_shard()]
    for coord in itertools.product(*map(range, mesh_shape)):
        slices = local_slices(shape, mesh_shape, placements, coord)
        block = index[slices]
        assert block.shape == local_shape(shape, mesh_shape, placements, coord)
        assert tuple(s.start for s in slices) == local_offsets(
            shape, mesh_shape, placements, coord
        )
        np.testing.assert_array_equal(block, expected[coord])
        stitched[slices] = block
        # Count each distinct shard once: the coordinates that are 0 on non-shard mesh dims.
        if all(c == 0 for m, c in enumerate(coord) if m not in shard_dims):
            coverage[slices] += 1
    np.testing.assert_array_equal(stitched, index)
    assert (coverage == 1).all()


@given(layouts())
def test_max_local_shape_is_the_largest_block(layout):
    shape, mesh_shape, placements = layout
    shapes = [
        local_shape(shape, mesh_shape, placements, coord)
        for coord in itertools.product(*map(range, mesh_shape))
    ]
    expected = tuple(max(s[d] for s in shapes) for d in range(len(shape)))
    assert max_local_shape(shape, mesh_shape, tuple(placements)) == expected
