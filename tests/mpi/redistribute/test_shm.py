"""MPI tests of the shared-memory exchanges: ranks read each other's pooled shards directly.

Tensors here are at least ``redistribute.shm.MIN_BYTES`` (1 MiB by default), so their
redistributes take the shared path; each test checks the values against numpy *and* that
the shared path (or, where intended, the MPI fallback) is what ran, from
``redistribute.shm.counts``. Run with
``mpiexec -n K python -m pytest tests/mpi/redistribute/test_shm.py --with-mpi`` for K = 1..4.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers.mpi import np_local
from mpi4py import MPI

import dtensor as dt
from dtensor.debug._spmd import check_spmd
from redistribute import shm

WORLD = MPI.COMM_WORLD
R, S, P = dt.Replicate(), dt.Shard, dt.Partial

pytestmark = [
    pytest.mark.mpi(min_size=2),
    pytest.mark.skipif(not shm.enabled(), reason="no shared segments here (DTENSOR_SHM=0)"),
]

# uneven over 3 and 4 ranks, and about 2 MiB in float32 (more than 1 MiB in every dtype:
# see shape_for)
SHAPE = (1031, 517)
REDUCE = {"sum": np.add, "avg": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}


def values(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if np.dtype(dtype).kind == "i":
        return rng.integers(-3, 4, shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def shape_for(dtype) -> tuple[int, int]:
    """SHAPE, with more columns where the dtype's items are small (1.2 MiB at least)."""
    cols = -(-int(1.2 * (1 << 20)) // (SHAPE[0] * np.dtype(dtype).itemsize))
    return SHAPE[0], max(SHAPE[1], cols)


def used(before: dict) -> dict:
    """What ``shm.counts`` gained since ``before``."""
    return {k: v - before.get(k, 0) for k, v in shm.counts.items() if v != before.get(k, 0)}


def expect_shared(before: dict, *kinds: str) -> None:
    gained = used(before)
    assert not any(k.endswith("fallback") for k in gained), gained
    for kind in kinds:
        assert gained.get(kind, 0) >= 1, (kind, gained)


def one_d():
    return dt.init_device_mesh((WORLD.size,))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64, np.bool_])
@pytest.mark.parametrize(
    ("src", "dst", "kind"),
    [
        ([S(0)], [S(1)], "all_to_all"),
        ([S(1)], [S(0)], "all_to_all"),
        ([S(0)], [R], "all_gather"),
        ([S(1)], [R], "all_gather"),
    ],
    ids=["S0-S1", "S1-S0", "S0-R", "S1-R"],
)
def test_shard_exchanges_read_peers_directly(src, dst, kind, dtype):
    g = values(shape_for(dtype), dtype, 1)
    mesh = one_d()
    x = dt.distribute_tensor(g, mesh, src)
    before = dict(shm.counts)
    y = x.redistribute(mesh, dst)
    expect_shared(before, kind)
    assert y.placements == tuple(dst)
    np.testing.assert_array_equal(y.to_local().numpy(), np_local(g, mesh, dst))
    back = y.redistribute(mesh, src)
    np.testing.assert_array_equal(back.to_local().numpy(), x.to_local().numpy())


#: (reduce op, dtype) of the Partial inputs: avg needs a floating dtype
OP_DTYPES = [(op, dtype) for op in REDUCE for dtype in (np.float64, np.int64, np.bool_)
             if op != "avg" or dtype == np.float64]  # fmt: skip


@pytest.mark.parametrize(("op", "dtype"), OP_DTYPES,
                         ids=[f"{op}-{dtype.__name__}" for op, dtype in OP_DTYPES])  # fmt: skip
@pytest.mark.parametrize(("dst", "kind"), [([R], "all_reduce"), ([S(0)], "reduce_scatter"),
                                           ([S(1)], "reduce_scatter")], ids=["R", "S0", "S1"])  # fmt: skip
def test_partial_reductions_read_peers_directly(op, dtype, dst, kind):
    parts = [values(shape_for(dtype), dtype, 10 + r) for r in range(WORLD.size)]
    want = parts[0]
    for part in parts[1:]:
        want = REDUCE[op](want, part)
    if op == "avg":
        want = want / WORLD.size
    mesh = one_d()
    x = dt.DTensor.from_local(dt.tensor(parts[WORLD.rank]), mesh, [P(op)])
    before = dict(shm.counts)
    y = x.redistribute(mesh, dst)
    expect_shared(before, kind)
    got = y.full_tensor().numpy()
    if dtype == np.float64:
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    else:
        np.testing.assert_array_equal(got, want)
    if dst == [R]:  # every rank holds the same bits
        mine = np.ascontiguousarray(y.to_local().numpy())
        first = WORLD.bcast(mine if WORLD.rank == 0 else None, root=0)
        assert mine.tobytes() == first.tobytes()


def test_transposed_local_inputs():
    """Non-contiguous shards (a transposed view of pooled memory) are read in place."""
    g = values((SHAPE[1], SHAPE[0]), np.float32, 3)
    mesh = one_d()
    src = dt.distribute_tensor(g, mesh, [S(1)])
    local_t = src.to_local().t()  # the S(0) shard of g.T, not contiguous
    assert not local_t.is_contiguous()
    x = dt.DTensor.from_local(local_t, mesh, [S(0)], shape=g.T.shape)
    for dst, kind in (([S(1)], "all_to_all"), ([R], "all_gather")):
        before = dict(shm.counts)
        y = x.redistribute(mesh, dst)
        expect_shared(before, kind)
        want = np_local(g.T, mesh, dst)
        np.testing.assert_array_equal(y.to_local().numpy(), want)
    # a Partial held as a transposed view
    parts = [values(SHAPE, np.float64, 20 + r) for r in range(WORLD.size)]
    local = dt.tensor(np.ascontiguousarray(parts[WORLD.rank].T)).t()
    x = dt.DTensor.from_local(local, mesh, [P("sum")])
    before = dict(shm.counts)
    got = x.redistribute(mesh, [R]).to_local().numpy()
    expect_shared(before, "all_reduce")
    np.testing.assert_allclose(got, sum(parts), rtol=1e-12, atol=1e-12)


@pytest.mark.mpi(min_size=4)
def test_sub_meshes_of_a_2x2_mesh():
    if WORLD.size != 4:
        pytest.skip("the 2x2 mesh needs exactly 4 ranks")
    mesh = dt.init_device_mesh((2, 2))
    g = values((1030, 1034), np.float32, 4)
    pairs = [
        ([S(0), S(1)], [S(1), S(0)]),
        ([S(0), S(0)], [R, R]),
        ([S(1), R], [S(0), S(1)]),
        ([R, S(0)], [S(1), R]),
    ]
    for src, dst in pairs:
        x = dt.distribute_tensor(g, mesh, src)
        before = dict(shm.counts)
        y = x.redistribute(mesh, dst)
        expect_shared(before)
        assert used(before), (src, dst)
        want = np_local(g, mesh, dst)
        np.testing.assert_array_equal(y.to_local().numpy(), want)
        np.testing.assert_array_equal(y.full_tensor().numpy(), g)


def test_one_rank_outside_shared_memory_sends_all_through_mpi():
    """A shard in ordinary memory on one rank (a wrapped numpy array) makes every rank take
    the MPI path for that exchange, with the same result."""
    g = values(SHAPE, np.float32, 5)
    mesh = one_d()
    pooled = dt.distribute_tensor(g, mesh, [S(0)])
    local = pooled.to_local()
    if WORLD.rank == 0:
        local = dt.from_numpy(np.array(local.numpy()))  # a copy in ordinary memory
        assert shm.locate(local.numpy()) is None
    x = dt.DTensor.from_local(local, mesh, [S(0)], shape=SHAPE)
    before = dict(shm.counts)
    y = x.redistribute(mesh, [S(1)])
    assert used(before) == {"all_to_all fallback": 1}
    want = np_local(g, mesh, [S(1)])
    np.testing.assert_array_equal(y.to_local().numpy(), want)


def test_observers_see_one_collective_per_shared_exchange():
    g = values(SHAPE, np.float32, 6)
    mesh = one_d()
    x = dt.distribute_tensor(g, mesh, [S(0)])
    p = dt.DTensor.from_local(dt.tensor(g), mesh, [P("max")])
    x.redistribute(mesh, [S(1)])  # the probe and first mappings happen outside the mode
    with dt.debug.CommDebugMode() as mode:
        before = dict(shm.counts)
        x.redistribute(mesh, [S(1)])
        p.redistribute(mesh, [R])
        expect_shared(before, "all_to_all", "all_reduce")
    assert mode.get_comm_counts() == {"all_to_all": 1, "all_reduce": 1}, mode.table()


def test_shared_exchanges_under_the_spmd_check():
    g = values(SHAPE, np.float64, 7)
    mesh = one_d()
    x = dt.distribute_tensor(g, mesh, [S(1)])
    with check_spmd():
        before = dict(shm.counts)
        y = x.redistribute(mesh, [S(0)]).redistribute(mesh, [R])
        expect_shared(before, "all_to_all", "all_gather")
    np.testing.assert_array_equal(y.to_local().numpy(), g)


def test_repeated_exchanges_reuse_memory_and_mappings():
    g = values(SHAPE, np.float32, 8)
    mesh = one_d()
    x = dt.distribute_tensor(g, mesh, [S(0)])
    for _ in range(3):  # warm up: pool blocks and peer mappings
        x.redistribute(mesh, [S(1)]).redistribute(mesh, [R])
    reserved = dt.memory_stats()["reserved_bytes"]
    maps = len(shm._peer_maps)
    for _ in range(20):
        y = x.redistribute(mesh, [S(1)]).redistribute(mesh, [R])
    np.testing.assert_array_equal(y.to_local().numpy(), g)
    assert dt.memory_stats()["reserved_bytes"] == reserved
    assert len(shm._peer_maps) == maps
    # freeing the cache drops the peer mappings (they keep the peers' memory alive); the
    # next exchanges map the peers' new segments
    del y
    dt.empty_cache()
    assert len(shm._peer_maps) == 0
    before = dict(shm.counts)
    y = x.redistribute(mesh, [S(1)]).redistribute(mesh, [R])
    expect_shared(before, "all_to_all", "all_gather")
    np.testing.assert_array_equal(y.to_local().numpy(), g)


def test_probe_agrees_on_the_world():
    from redistribute import comm as C

    results = WORLD.allgather(shm.probe(C.world()))
    assert results == [True] * WORLD.size, results


def test_a_rank_that_makes_no_shared_segments_does_not_diverge(monkeypatch):
    """Whether an exchange tries the shared path is decided the same way on every rank,
    even when one rank has stopped making shared segments: here rank 0 (shared segments
    off, its shard in ordinary memory) and the others agree on the MPI path for a program
    compiled afterwards."""
    shape = (1033, 523)  # a spec no earlier test compiled
    g = values(shape, np.float32, 9)
    mesh = one_d()
    dt.distribute_tensor(g, mesh, [S(1)]).redistribute(mesh, [R])  # probes the mesh's comm
    assert mesh.get_all_groups()[0].shared is True
    monkeypatch.setattr(shm, "_ENABLED", WORLD.rank != 0)
    pooled = dt.distribute_tensor(g, mesh, [S(0)]).to_local()
    local = dt.from_numpy(np.array(pooled.numpy())) if WORLD.rank == 0 else pooled
    x = dt.DTensor.from_local(local, mesh, [S(0)], shape=shape)
    before = dict(shm.counts)
    y = x.redistribute(mesh, [S(1)])
    assert used(before) == {"all_to_all fallback": 1}
    want = np_local(g, mesh, [S(1)])
    np.testing.assert_array_equal(y.to_local().numpy(), want)
    # rank 0's pool now holds segments in ordinary memory: give them back, so that later
    # tests (which expect shared blocks) do not reuse them
    del pooled, local, x, y, want
    monkeypatch.undo()
    dt.empty_cache()


def test_a_rank_that_cannot_map_a_peer_sends_everyone_down_the_mpi_path(monkeypatch):
    """Rank 1 fails to map its peers' segments: every rank falls back to MPI for that
    exchange and the results stay exact, including an all-reduce that works in place on a
    buffer of its own (a transposed Partial is first made contiguous)."""
    g = values(SHAPE, np.float32, 11)
    mesh = one_d()
    x = dt.distribute_tensor(g, mesh, [S(0)])
    parts = [values(SHAPE, np.float64, 30 + r) for r in range(WORLD.size)]
    p = dt.DTensor.from_local(dt.tensor(np.ascontiguousarray(parts[WORLD.rank].T)).t(), mesh,
                              [P("sum")])  # fmt: skip
    x.redistribute(mesh, [S(1)])  # probe and map while mapping works
    if WORLD.rank == 1:
        def refuse(*args):
            raise OSError("mapping refused for the test")

        monkeypatch.setattr(shm, "peer_buffer", refuse)
    before = dict(shm.counts)
    y = x.redistribute(mesh, [S(1)])
    r = p.redistribute(mesh, [R])
    s = p.redistribute(mesh, [S(0)])
    assert used(before) == {
        "all_to_all fallback": 1, "all_reduce fallback": 1, "reduce_scatter fallback": 1
    }
    want = np_local(g, mesh, [S(1)])
    np.testing.assert_array_equal(y.to_local().numpy(), want)
    total = sum(parts)
    np.testing.assert_allclose(r.to_local().numpy(), total, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(s.full_tensor().numpy(), total, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("src_rank", [0, -1], ids=["from-0", "from-last"])
def test_distribute_tensor_reads_the_source_directly(src_rank):
    """Scatter and broadcast of a large tensor: the ranks copy their blocks out of the
    source rank's shared buffer; Partial identity holders still get the identity."""
    src = src_rank % WORLD.size
    g = values(SHAPE, np.float32, 12)
    meshes = [one_d()] + ([dt.init_device_mesh((2, 2))] if WORLD.size == 4 else [])
    for mesh in meshes:
        for pl in ([S(0)], [S(1)], [R], [P("sum")], [P("max")]):
            pl = pl + [S(0)] * (mesh.ndim - 1)
            before = dict(shm.counts)
            x = dt.distribute_tensor(g if WORLD.rank == src else None, mesh, pl, src_data_rank=src)
            kind = "scatter" if any(p.is_shard() for p in pl) else "broadcast"
            expect_shared(before, kind)
            if any(p.is_partial() for p in pl):  # the identity holders: dtensor's layout
                want = dt.distribute_tensor(g, mesh, pl, src_data_rank=None).to_local().numpy()
            else:
                want = np_local(g, mesh, pl)
            np.testing.assert_array_equal(x.to_local().numpy(), want, err_msg=str(pl))
            np.testing.assert_array_equal(x.full_tensor().numpy(), g, err_msg=str(pl))
