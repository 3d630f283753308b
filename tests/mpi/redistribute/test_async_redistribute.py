"""``redistribute(..., async_op=True)`` and the persistent all-gathers of redistributes.

- For every plan kind (all-gather, all-to-all, all-reduce, reduce-scatter, local chunk,
  local steps before and after a collective, multi-step 2-D plans, shared-memory sizes of
  at least 1 MiB), on 1-D and 2-D meshes with uneven shards, the asynchronous result equals
  the blocking one, and the plan takes the expected path: one MPI nonblocking collective
  started in the caller's thread (:class:`redistribute.worker.Started`), or the worker
  thread (:class:`redistribute.worker.Pending`).
- A nonblocking start made while the worker still has jobs queued on one rank and not on
  the other matches (the order of each communicator's collectives is the same).
- A pending DTensor waits on any use of its data (ops, ``to_local``, ``full_tensor``,
  ``redistribute``, numpy, repr) and on ``wait()``; its metadata is there at once.
- A pending DTensor dropped unused leaves no job and no buffer behind, and the next
  collectives work.
- CommDebugMode and ``explain`` mark asynchronous collectives.
- Persistent all-gathers: repeated calls give fresh outputs (an earlier output never
  changes), and a rank-local cache clear on one rank does not break matching.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
from mpi4py import MPI

import dtensor as dt
from dtensor.debug import CommDebugMode, explain
from redistribute import comm as rcomm
from redistribute import worker
from redistribute.execute import execute_async
from redistribute.execute import programs as EP
from redistribute.plan import plan

WORLD = MPI.COMM_WORLD
S, R, P = dt.Shard, dt.Replicate(), dt.Partial

NB, WORKER = True, False  # the path of a plan: one nonblocking collective, or the worker

# (global shape, source placements, target placements, path): 1-D meshes
CASES_1D = [
    ((10, 6), [S(0)], [R], NB),  # Iallgather(v) (uneven at 3 and 4 ranks)
    ((7, 6), [S(1)], [R], NB),  # all-gather staged (blocks strided in the output)
    ((9, 7), [S(0)], [S(1)], NB),  # Ialltoallw
    ((6, 5), [P("sum")], [R], NB),  # Iallreduce
    ((6, 5), [P("avg")], [R], NB),  # divided at completion
    ((7, 5), [P("sum")], [S(0)], NB),  # Ireduce_scatter
    ((7, 5), [R], [S(1)], NB),  # local chunk: nothing to start
    ((600, 500), [S(0)], [R], WORKER),  # 1.2 MB: shared-memory exchange
    ((600, 500), [S(1)], [S(0)], WORKER),  # shared-memory all-to-all
    ((600, 500), [P("sum")], [R], WORKER),  # shared-memory all-reduce
]

# 2-D meshes (2 x k): multi-step plans, nested shards, local steps around one collective
CASES_2D = [
    ((7, 5), [S(0), S(0)], [R, R], WORKER),
    ((7, 9), [S(0), S(1)], [S(1), S(0)], WORKER),
    ((6, 5), [P("sum"), S(0)], [R, R], WORKER),
    ((7, 5), [R, S(1)], [S(0), R], NB),  # local chunk, then an all-gather
    ((7, 5), [R, S(0)], [S(0), R], NB),  # all-gather, then a local chunk
    ((9, 7), [P("sum"), R], [S(1), S(1)], NB),  # reduce-scatter, then a local chunk
    ((6, 5), [S(1), P("avg")], [S(1), R], NB),
    ((700, 400), [S(0), S(1)], [R, R], WORKER),  # 1.1 MB: shared-memory exchanges
    ((600, 500), [S(1), S(0)], [R, S(1)], WORKER),
]


def _source(shape, placements, mesh):
    """A DTensor of the global ``data`` (Partial: each coordinate holds its contribution)."""
    data = (np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) % 97) * 0.5 - 3
    coord = mesh.get_coordinate()
    if any(p.is_partial() for p in placements):
        # contributions (i + 1) * data / total over the partial mesh dims (times the group
        # size for an average)
        k = 1
        mine = 1
        for m, p in enumerate(placements):
            if p.is_partial():
                n = mesh.size(m)
                mine, k = mine * (coord[m] + 1), k * (n * (n + 1) // 2)
                mine *= n if p.reduce_op == "avg" else 1
        keep = [p if not p.is_partial() else R for p in placements]
        full = dt.distribute_tensor(data, mesh, keep, src_data_rank=None).to_local().numpy()
        local = full * np.float32(mine) / np.float32(k)
        x = dt.DTensor.from_local(local, mesh, placements, shape=shape)
        return x, data
    return dt.distribute_tensor(data, mesh, placements), data


def _same(a, b):
    assert tuple(a.placements) == tuple(b.placements)
    la, lb = a.to_local().numpy(), b.to_local().numpy()
    assert la.shape == lb.shape and la.dtype == lb.dtype
    np.testing.assert_allclose(la, lb, rtol=1e-6, atol=1e-5)


def _shared(steps, spec, coord):
    """Whether the executor's program of the plan exchanges through node-shared memory."""
    return any(r.pulls is not None if type(r) is EP.ExchangeRunner else getattr(r, "shared", False)
               for r in EP.get_program(tuple(steps), spec, tuple(coord)))


def _check(mesh, shape, src, dst, path):
    x, data = _source(shape, src, mesh)
    blocking = x.redistribute(mesh, dst)
    pending = x.redistribute(mesh, dst, async_op=True)
    assert tuple(pending.placements) == tuple(dst) and pending.shape == shape
    assert pending.wait() is pending and type(pending) is dt.DTensor
    _same(pending, blocking)
    np.testing.assert_allclose(pending.full_tensor().numpy(), data, rtol=1e-6, atol=1e-5)
    # the executor's handle: the path the plan takes (a 1-rank group communicates nothing)
    spec, local = x._spec, x.to_local().numpy()
    steps = plan(spec, tuple(dst))
    handle = execute_async(steps, local, spec, mesh._coord, mesh._dim_comms)
    # a case labelled NB goes to the worker when its exchange takes node-shared memory, as
    # every exchange does where DTENSOR_SHM_MIN_BYTES=0 (the test runner's Python-path stages)
    nb = (path == NB and not _shared(steps, spec, mesh._coord)) or all(
        mesh.size(s.mesh_dim) == 1 for s in steps)
    assert type(handle) is (worker.Started if nb else worker.Pending)
    np.testing.assert_array_equal(handle.wait(), blocking.to_local().numpy())


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("shape,src,dst,path", CASES_1D)
def test_async_equals_blocking_1d(shape, src, dst, path):
    _check(dt.init_device_mesh((WORLD.size,)), shape, src, dst, path)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("shape,src,dst,path", CASES_2D)
def test_async_equals_blocking_2d(shape, src, dst, path):
    _check(dt.init_device_mesh((2, WORLD.size // 2)), shape, src, dst, path)


@pytest.mark.mpi(min_size=2)
@pytest.mark.mode_independent
def test_nonblocking_start_behind_worker_jobs_on_one_rank_only_matches():
    # rank 0 lets its worker finish a shared-memory job and starts the small gathers in its
    # own thread; the others start them at once, queued behind their worker's job
    mesh = dt.init_device_mesh((WORLD.size,))
    big, big_data = _source((600, 500), [S(1)], mesh)
    small, data = _source((10, 6), [S(0)], mesh)
    for _ in range(3):
        z = big.redistribute(mesh, [R], async_op=True)
        if WORLD.rank == 0:
            z.wait()
        ys = [small.redistribute(mesh, [R], async_op=True) for _ in range(2)]
        for y in ys:
            np.testing.assert_array_equal(y.to_local().numpy(), data)
        np.testing.assert_array_equal(z.to_local().numpy(), big_data)


@pytest.mark.mpi(min_size=2)
def test_async_calls_in_flight_together_keep_their_order():
    mesh = dt.init_device_mesh((WORLD.size,))
    sources = [_source((9 + i, 5), [S(0)], mesh) for i in range(3)]
    xs = [x for x, _ in sources]
    ys = [x.redistribute(mesh, [S(1)], async_op=True) for x in xs]
    zs = [x.redistribute(mesh, [R], async_op=True) for x in xs]
    blocking = [x.full_tensor() for x in xs]  # on the mesh's own communicators meanwhile
    for (_, data), y, z, b in zip(sources, ys, zs, blocking):
        np.testing.assert_array_equal(b.numpy(), data)
        np.testing.assert_array_equal(z.to_local().numpy(), data)
        np.testing.assert_array_equal(y.full_tensor().numpy(), data)


USES = {
    "op": lambda y: (y + 1).full_tensor().numpy() - 1,
    "matmul": lambda y: (
        (y @ dt.DTensor.from_local(np.eye(6, dtype=np.float32), y.device_mesh, [R]))
        .full_tensor()
        .numpy()
    ),
    "to_local": lambda y: y.to_local().numpy(),
    "full_tensor": lambda y: y.full_tensor().numpy(),
    "redistribute": lambda y: y.redistribute(y.device_mesh, [S(0)]).full_tensor().numpy(),
    "numpy": lambda y: np.asarray(y.to_local()),
    "repr": lambda y: (repr(y), y.to_local().numpy())[1],
}


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("use", sorted(USES))
def test_any_use_of_a_pending_dtensor_waits(use):
    mesh = dt.init_device_mesh((WORLD.size,))
    x, data = _source((10, 6), [S(0)], mesh)
    y = x.redistribute(mesh, [R], async_op=True)
    assert isinstance(y, dt.DTensor) and y.shape == (10, 6) and y.dtype == np.float32
    got = USES[use](y)
    np.testing.assert_allclose(got, data, rtol=1e-6, atol=1e-5)
    assert type(y) is dt.DTensor  # settled: a plain DTensor again


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("src,dst", [((S(0),), (R,)), ((S(1),), (S(0),)), ((P("sum"),), (R,))])
def test_gradients_flow_through_an_async_redistribute(src, dst):
    # a pending DTensor records like a plain one: its ops are differentiated, and the
    # redistribute's backward takes the gradient back to the input's placements
    mesh = dt.init_device_mesh((WORLD.size,))
    a = np.arange(30.0).reshape(6, 5) / 10
    want = 2 * a + np.exp(a) / a.size  # d/da of sum(a * a) + mean(exp(a))
    grads = []
    for async_op in (False, True):
        x = dt.distribute_tensor(a, mesh, list(src)).requires_grad_()
        y = x.redistribute(mesh, list(dst), async_op=async_op)
        ((y * y).sum() + y.exp().mean()).backward()
        grads.append((tuple(x.grad.placements), x.grad.full_tensor().numpy()))
        np.testing.assert_allclose(grads[-1][1], want, rtol=1e-12, err_msg=f"async {async_op}")
    assert grads[0][0] == grads[1][0]


@pytest.mark.mpi(min_size=2)
def test_dropped_pending_dtensor_leaves_nothing_behind():
    mesh = dt.init_device_mesh((WORLD.size,))
    x, data = _source((600, 500), [S(0)], mesh)  # pooled buffers
    small = _source((40, 30), [S(1)], mesh)[0]  # nonblocking starts (pooled outputs)
    x.redistribute(mesh, [R]).to_local()  # warm the pools
    worker.drain()
    gc.collect()
    before = dt.memory_stats()["allocated_bytes"]
    for _ in range(3):
        x.redistribute(mesh, [R], async_op=True)  # dropped at once: the worker
        x.redistribute(mesh, [S(1)], async_op=True)
        small.redistribute(mesh, [R], async_op=True)  # Iallgather, staged
        small.redistribute(mesh, [S(0)], async_op=True)  # Ialltoallw
    worker.drain()
    assert worker.pending_count() == 0
    gc.collect()
    assert dt.memory_stats()["allocated_bytes"] == before
    # the next collectives, blocking and asynchronous, still match
    np.testing.assert_array_equal(x.full_tensor().numpy(), data)
    np.testing.assert_array_equal(x.redistribute(mesh, [R], async_op=True).to_local().numpy(), data)


@pytest.mark.mpi(min_size=2)
def test_comm_debug_mode_and_explain_mark_async_collectives():
    mesh = dt.init_device_mesh((WORLD.size,))
    x, _ = _source((10, 6), [S(0)], mesh)
    with CommDebugMode() as mode:
        x.redistribute(mesh, [R], async_op=True).wait()
        x.redistribute(mesh, [R])
    kinds = [(r.kind, r.async_op) for r in mode.records]
    assert kinds == [("all_gather", True), ("all_gather", False)]
    assert mode.get_async_counts() == 1
    assert "all_gather (async)" in mode.table()
    text = str(explain(x, [R], async_op=True))
    assert "all_gather(" in text and ", async)" in text
    assert ", async" not in str(explain(x, [R]))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("shape", [(8, 8), (5, 3)])  # Allgather, Allgatherv
def test_persistent_gathers_give_fresh_outputs(shape):
    mesh = dt.init_device_mesh((WORLD.size,))
    prev = rcomm.set_persistent(True)
    try:
        on = rcomm.persistent_enabled()  # False where MPI has no persistent collectives
        a, data_a = _source(shape, [S(0)], mesh)
        b = dt.distribute_tensor(-data_a, mesh, [S(0)])
        first = a.redistribute(mesh, [R])
        kept = first.to_local().numpy().copy()
        second = b.redistribute(mesh, [R])
        third = a.redistribute(mesh, [R])
        np.testing.assert_array_equal(first.to_local().numpy(), kept)  # not overwritten
        np.testing.assert_array_equal(second.to_local().numpy(), -data_a)
        np.testing.assert_array_equal(third.to_local().numpy(), data_a)
        live = [p for p in mesh._dim_comms[0].pool.values() if p.request is not None]
        assert bool(live) == on  # persistent requests, or the blocking fallback
    finally:
        rcomm.set_persistent(prev)


@pytest.mark.mpi(min_size=2)
def test_rank_local_cache_clear_keeps_persistent_gathers_matched():
    mesh = dt.init_device_mesh((WORLD.size,))
    x, data = _source((8, 8), [S(0)], mesh)
    for i in range(4):
        if WORLD.rank == 0 and i % 2:
            dt.clear_caches()  # on one rank only
        np.testing.assert_array_equal(x.redistribute(mesh, [R]).to_local().numpy(), data)


@pytest.mark.mpi(min_size=2)
def test_persistent_and_blocking_agree_when_switched_together():
    mesh = dt.init_device_mesh((WORLD.size,))
    x, data = _source((5, 3), [S(0)], mesh)
    prev = rcomm.set_persistent(False)
    try:
        np.testing.assert_array_equal(x.redistribute(mesh, [R]).to_local().numpy(), data)
    finally:
        rcomm.set_persistent(prev)
    np.testing.assert_array_equal(x.redistribute(mesh, [R]).to_local().numpy(), data)


@pytest.mark.mpi(min_size=2)
def test_set_persistent_on_one_rank_raises_instead_of_hanging():
    """set_persistent(True) on one rank alone hung the next S(0)->R (MPI never matches a
    persistent all-gather with a blocking one): it is collective, the lone rank raises
    CommError after its timeout with its setting unchanged, and ranks asking for different
    settings all raise ConfigError."""
    from dtensor.errors import CommError, ConfigError

    mesh = dt.init_device_mesh((WORLD.size,))
    x, data = _source((8, 8), [S(0)], mesh)
    prev = rcomm.set_persistent(False)
    try:
        if WORLD.rank == 0:
            with pytest.raises(CommError, match="did not call set_persistent within 1 s"):
                rcomm.set_persistent(True, timeout=1.0)
        assert not rcomm.persistent_enabled()
        for _ in range(2):  # every rank still runs the blocking all-gather
            np.testing.assert_array_equal(x.redistribute(mesh, [R]).to_local().numpy(), data)
        rcomm.set_persistent(False)  # every rank's next call: it completes rank 0's
        if rcomm.persistent._HAS_PERSISTENT:
            with pytest.raises(ConfigError, match="asked for different settings"):
                rcomm.set_persistent(WORLD.rank == 0)
            assert not rcomm.persistent_enabled()
        np.testing.assert_array_equal(x.redistribute(mesh, [R]).to_local().numpy(), data)
        rcomm.set_persistent(True)  # together: both on
        assert rcomm.persistent_enabled() == rcomm.persistent._HAS_PERSISTENT
        np.testing.assert_array_equal(x.redistribute(mesh, [R]).to_local().numpy(), data)
    finally:
        rcomm.set_persistent(prev)
