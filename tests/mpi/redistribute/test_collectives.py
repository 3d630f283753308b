"""MPI tests of :mod:`redistribute.comm`: the buffer-based collectives (uneven and zero
counts), reduce-op mapping, derived block types, mesh communicators and observers.

Run with ``mpiexec -n K python -m pytest tests/mpi/redistribute/test_collectives.py --with-mpi``.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from placements.errors import CommError, DTypeError, MeshError
from redistribute import comm as C

WORLD = MPI.COMM_WORLD.Get_size()
pytestmark = [pytest.mark.mpi(min_size=1), pytest.mark.mode_independent]  # see tests/conftest.py


@pytest.fixture
def world():
    return C.world()


@pytest.fixture
def observed():
    """Kinds, byte counts and mesh dims seen by an observer during the test."""
    seen = []

    def observer(kind, nbytes, comm):
        seen.append((kind, nbytes, comm.mesh_dim))

    C.add_observer(observer)
    yield seen
    C.remove_observer(observer)


def rank_data(rank, n, dtype, seed):
    """Rank ``rank``'s ``n`` values (any rank can compute any other rank's)."""
    rng = np.random.default_rng([seed, rank, n])
    if np.dtype(dtype).kind == "b":
        return rng.random(n) < 0.5
    return (rng.standard_normal(n) * 10).astype(dtype)


def uneven_counts(size, salt=0):
    """Element counts per rank, some of them zero."""
    return [(3 * r + salt) % 4 for r in range(size)]


def make_counts(kind, size, salt=0):
    """Equal counts (the non-v collective is used) or uneven ones (the v variant)."""
    return [3] * size if kind == "even" else uneven_counts(size, salt)


# -- data movement --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["even", "uneven"])
@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.bool_, np.complex128, np.float16])
def test_allgatherv_uneven_and_zero_counts(world, seed, dtype, kind, observed):
    counts = make_counts(kind, world.size)
    parts = [rank_data(r, counts[r], dtype, seed) for r in range(world.size)]
    out = np.empty(sum(counts), dtype)
    world.allgatherv(parts[world.rank], out, counts)
    np.testing.assert_array_equal(out, np.concatenate(parts))
    assert observed == [("all_gather", out.nbytes, None)]


def test_allgatherv_with_displacements(world, seed):
    """Blocks land at explicit displacements (here in reverse rank order, with gaps)."""
    counts = uneven_counts(world.size, 1)
    displs, pos = [0] * world.size, 0
    for r in reversed(range(world.size)):
        displs[r], pos = pos, pos + counts[r] + 1
    out = np.full(pos, -1.0)
    world.allgatherv(
        rank_data(world.rank, counts[world.rank], np.float64, seed), out, counts, displs
    )
    want = np.full(pos, -1.0)
    for r in range(world.size):
        want[displs[r] : displs[r] + counts[r]] = rank_data(r, counts[r], np.float64, seed)
    np.testing.assert_array_equal(out, want)


def test_alltoallv_uneven_and_zero_counts(world, seed, observed):
    k, me = world.size, world.rank

    def count(src, dst):  # elements rank src sends to rank dst
        return (src + 2 * dst) % 3

    def block(src, dst):
        return rank_data(src * k + dst, count(src, dst), np.int64, seed)

    scounts = [count(me, j) for j in range(k)]
    rcounts = [count(i, me) for i in range(k)]
    sdispls = np.cumsum([0] + scounts[:-1]).tolist()
    rdispls = np.cumsum([0] + rcounts[:-1]).tolist()
    send = np.concatenate([block(me, j) for j in range(k)])
    recv = np.empty(sum(rcounts), np.int64)
    world.alltoallv(send, scounts, sdispls, recv, rcounts, rdispls)
    np.testing.assert_array_equal(recv, np.concatenate([block(i, me) for i in range(k)]))
    assert observed == [("all_to_all", max(send.nbytes, recv.nbytes), None)]


def test_alltoallw_receives_strided_blocks_in_place(world, seed, observed):
    """Every rank sends a contiguous (4, w_i) block; each lands as columns of a (4, W) matrix
    through a derived type, and the columns outside any block stay untouched."""
    k, me = world.size, world.rank
    widths = [1 + r % 3 for r in range(k)]
    starts = np.cumsum([0] + widths[:-1]).tolist()
    total = sum(widths) + 1  # one spare column
    mine = rank_data(me, 4 * widths[me], np.float64, seed).reshape(4, widths[me])
    out = np.full((4, total), np.nan)
    isz = out.itemsize
    rtypes, rcounts, rdispls = [], [], []
    for i in range(k):
        count, dtype = C.block_type((4, widths[i]), (total * isz, isz), isz)
        assert (dtype is C.BYTES) == (widths[i] == total)
        rtypes.append(dtype)
        rcounts.append(count)
        rdispls.append(starts[i] * isz)
    try:
        world.alltoallw(
            mine, [mine.nbytes] * k, [0] * k, [C.BYTES] * k, out, rcounts, rdispls, rtypes,
            kind="all_gather",
        )  # fmt: skip
    finally:
        C.free_types(rtypes)
    for i in range(k):
        want = rank_data(i, 4 * widths[i], np.float64, seed).reshape(4, widths[i])
        np.testing.assert_array_equal(out[:, starts[i] : starts[i] + widths[i]], want)
    assert np.isnan(out[:, -1]).all()
    received = 4 * sum(widths) * isz
    assert observed == [("all_gather", max(mine.nbytes * k, received), None)]


def test_scatterv_uneven_in_place_root(world, seed, observed):
    counts = uneven_counts(world.size, 2)
    displs = np.cumsum([0] + counts[:-1]).tolist()
    root = world.size - 1
    full = np.concatenate([rank_data(r, counts[r], np.float32, seed) for r in range(world.size)])
    mine = full[displs[world.rank] : displs[world.rank] + counts[world.rank]]
    if world.rank == root:  # root keeps its block where it is (recv=None)
        world.scatterv(full, counts, displs, None, root)
    else:
        out = np.empty(counts[world.rank], np.float32)
        world.scatterv(None, counts, displs, out, root)
        np.testing.assert_array_equal(out, mine)
    assert [k for k, _, _ in observed] == ["scatter"]


def test_bcast_barrier_and_allgather_ints(world, seed, observed):
    arr = rank_data(0, 5, np.complex64, seed) if world.rank == 0 else np.zeros(5, np.complex64)
    assert world.bcast_array(arr, 0) is arr
    np.testing.assert_array_equal(arr, rank_data(0, 5, np.complex64, seed))
    world.barrier()
    got = world.allgather_ints([world.rank, -world.rank, 2**40])
    assert got.dtype == np.int64 and got.shape == (world.size, 3)
    np.testing.assert_array_equal(got[:, 0], np.arange(world.size))
    np.testing.assert_array_equal(got[:, 1], -np.arange(world.size))
    assert (got[:, 2] == 2**40).all()
    assert observed == [
        ("broadcast", arr.nbytes, None),
        ("barrier", 0, None),
        ("all_gather_ints", got.nbytes, None),
    ]


# -- reductions ---------------------------------------------------------------------------

NUMPY_OPS = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}


def reduced(op, parts):
    if op == "avg":
        return sum(parts) / len(parts)
    return NUMPY_OPS[op].reduce(np.stack(parts), axis=0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64, np.float16, np.bool_])
@pytest.mark.parametrize("op", ["sum", "avg", "max", "min", "prod"])
@pytest.mark.parametrize("in_place", [False, True])
def test_allreduce(world, seed, dtype, op, in_place, observed):
    if op == "avg" and np.dtype(dtype).kind != "f":
        with pytest.raises(DTypeError, match="avg"):
            world.allreduce(np.ones(3, dtype), None, op)
        assert observed == []
        return
    parts = [rank_data(r, 6, dtype, seed) for r in range(world.size)]
    if np.dtype(dtype).kind == "f":
        parts = [np.round(p) / 4 for p in parts]  # exact in every float dtype
    send = parts[world.rank].copy()
    if in_place:
        world.allreduce(send, None, op)
        out = send
    else:
        out = np.empty_like(send)
        world.allreduce(send, out, op)
        np.testing.assert_array_equal(send, parts[world.rank])  # input untouched
    want = reduced(op, parts)
    if np.dtype(dtype) == np.bool_:  # bool sum/max: logical or; prod/min: logical and
        want = np.logical_or.reduce(parts) if op in ("sum", "max") else np.logical_and.reduce(parts)
    assert out.dtype == np.dtype(dtype)
    rtol = 1e-2 if np.dtype(dtype) == np.float16 else 1e-6
    np.testing.assert_allclose(out.astype(np.float64), want.astype(np.float64), rtol=rtol)
    assert observed == [("all_reduce", send.nbytes, None)]


@pytest.mark.parametrize("kind", ["even", "uneven"])
@pytest.mark.parametrize("op", ["sum", "avg", "max"])
def test_reduce_scatter_uneven_and_zero_counts(world, seed, op, kind, observed):
    counts = make_counts(kind, world.size, 3)
    parts = [np.round(rank_data(r, sum(counts), np.float64, seed)) for r in range(world.size)]
    out = np.empty(counts[world.rank])
    world.reduce_scatter(parts[world.rank], out, counts, op)
    start = sum(counts[: world.rank])
    np.testing.assert_allclose(out, reduced(op, parts)[start : start + counts[world.rank]])
    assert observed == [("reduce_scatter", parts[world.rank].nbytes, None)]


def test_reduction_errors(world):
    with pytest.raises(DTypeError, match="unknown reduce op 'mean'"):
        world.allreduce(np.ones(2), None, "mean")
    with pytest.raises(DTypeError, match="complex"):
        world.allreduce(np.ones(2, np.complex128), None, "max")
    with pytest.raises(DTypeError, match="cannot reduce"):
        world.reduce_scatter(np.ones(world.size, "U1"), np.ones(1, "U1"), [1] * world.size)
    with pytest.raises(DTypeError, match="cannot reduce"):
        world.allreduce(np.ones(2, ">f8"), None, "sum")  # non-native byte order


# -- datatypes ----------------------------------------------------------------------------


def test_block_type_geometry():
    assert C.block_type((3, 4), (16, 4), 4) == (48, C.BYTES)  # contiguous
    assert C.block_type((1, 5, 1), (999, 8, 7), 8) == (40, C.BYTES)  # size-1 dims
    assert C.block_type((0, 4), (32, 4), 4) == (0, C.BYTES)  # empty
    count, dtype = C.block_type((3, 2, 4), (96, 32, 4), 4)  # (3, 2, 4) in (3, 3, 8)
    try:
        assert count == 1
        assert dtype.Get_size() == 3 * 2 * 16
        assert dtype.Get_extent() == (0, 2 * 96 + 32 + 16)
    finally:
        C.free_types([dtype, C.BYTES])  # predefined types are skipped
    assert dtype == MPI.DATATYPE_NULL


def test_block_type_places_elements_in_c_order():
    """Every other column of a (4, 8) float64 matrix: no contiguous run beyond one element."""
    out = np.zeros((4, 8))
    block = out[:, 0:6:2]
    count, dtype = C.block_type(block.shape, block.strides, out.itemsize)
    values = np.arange(1.0, 13.0)
    try:
        MPI.COMM_SELF.Sendrecv([values, MPI.DOUBLE], 0, 0, [out, count, dtype], 0, 0)
    finally:
        C.free_types([dtype])
    np.testing.assert_array_equal(block, values.reshape(4, 3))
    assert out[:, 1::2].sum() == 0 and out[:, 6:].sum() == 0


# -- communicators ------------------------------------------------------------------------


def test_comm_wrapper_attributes(world):
    assert (world.rank, world.size, world.mesh_dim) == (
        MPI.COMM_WORLD.Get_rank(),
        WORLD,
        None,
    )
    assert world.mpi is MPI.COMM_WORLD
    with pytest.raises(CommError):
        C.Comm(MPI.COMM_NULL)
    with pytest.raises(CommError):
        C.Comm("not a communicator")


def check_mesh(world, grid):
    coord, comms = C.make_mesh_comms(world, grid)
    try:
        assert grid[coord] == world.rank
        assert len(comms) == grid.ndim
        for m, comm in enumerate(comms):
            assert comm.mesh_dim == m and comm.rank == coord[m] and comm.size == grid.shape[m]
            members = comm.allgather_ints([world.rank])[:, 0]
            line = grid[coord[:m] + (slice(None),) + coord[m + 1 :]]
            np.testing.assert_array_equal(members, line)  # ordered by the coordinate
    finally:
        for comm in comms:
            comm.free()


def test_make_mesh_comms_1d(world):
    check_mesh(world, np.arange(WORLD))
    check_mesh(world, np.arange(WORLD)[::-1].copy())


@pytest.mark.mpi(min_size=4)
@pytest.mark.skipif(WORLD != 4, reason="2x2 mesh needs 4 ranks")
def test_make_mesh_comms_2x2(world):
    check_mesh(world, np.arange(4).reshape(2, 2))
    check_mesh(world, np.arange(4).reshape(2, 2).T.copy())
    check_mesh(world, np.array([[3, 1], [0, 2]]))


@pytest.mark.mpi(min_size=2)
def test_make_mesh_comms_subset(world):
    """Ranks outside the grid take part in the splits and get no communicators."""
    grid = np.arange(1, WORLD)
    coord, comms = C.make_mesh_comms(world, grid)
    if world.rank == 0:
        assert (coord, comms) == (None, ())
    else:
        assert coord == (world.rank - 1,) and comms[0].size == WORLD - 1
    for comm in comms:
        comm.free()


@pytest.mark.mpi(min_size=2)
def test_make_mesh_comms_rejects_different_grids(world):
    grid = np.arange(WORLD) if world.rank else np.arange(WORLD)[::-1].copy()
    with pytest.raises(MeshError, match="different rank grids"):
        C.make_mesh_comms(world, grid)


def test_make_mesh_comms_rejects_bad_grids(world):
    with pytest.raises(MeshError, match="distinct ranks"):
        C.make_mesh_comms(world, np.zeros(WORLD + 1, np.int64))
    with pytest.raises(MeshError, match="distinct ranks"):
        C.make_mesh_comms(world, np.arange(WORLD) + 1)
    with pytest.raises(MeshError, match="integer array"):
        C.make_mesh_comms(world, np.zeros(2))


# -- observers ----------------------------------------------------------------------------


def test_observers_see_sub_communicators_and_can_be_removed(world):
    seen = []

    def observer(kind, nbytes, comm):
        seen.append((kind, nbytes, comm.mesh_dim, comm.size))

    _, (comm,) = C.make_mesh_comms(world, np.arange(WORLD))
    C.add_observer(observer)
    try:
        comm.allreduce(np.ones(4, np.float32))
    finally:
        C.remove_observer(observer)
    comm.allreduce(np.ones(4, np.float32))  # not observed any more
    comm.free()
    assert seen == [("all_reduce", 16, 0, WORLD)]
    with pytest.raises(CommError, match="not a registered observer"):
        C.remove_observer(observer)
