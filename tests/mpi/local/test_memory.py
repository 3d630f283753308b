"""Memory safety under MPI: the caching allocator's statistics after long mixed workloads.

- 10,000 mixed ops and redistributes (500 rounds of 20) leave ``dt.memory_stats()`` at its baseline (no live
  block leaks), including ops that fail;
- in a steady loop the reserved memory stops growing after the first iterations (freed
  blocks are reused: cache hits, no new segments);
- views keep their storage alive after the base is gone, and release it with the last view.

Shards are above ``POOL_MIN_BYTES`` so that every buffer goes through the pool.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
from mpi4py import MPI

import dtensor as dt
from dtensor.errors import ShardingError
from dtensor.local import allocator as _allocator

WORLD = MPI.COMM_WORLD
R, S, P = dt.Replicate(), dt.Shard, dt.Partial
ROWS, COLS = 128, 128  # float32: half a shard on 4 ranks is 8 KiB


def stats() -> dict[str, int]:
    gc.collect()
    return dt.memory_stats()


def data(shape, seed):
    return np.random.default_rng(seed).integers(-3, 4, size=shape).astype(np.float32)


@pytest.fixture(scope="module")
def mesh():
    return dt.init_device_mesh((WORLD.size,))


@pytest.mark.mpi(min_size=1)
def test_shards_are_pooled():
    # the smallest buffer of the workload (half a shard on the largest world) is pooled
    assert ROWS * COLS * 4 // WORLD.size // 2 >= _allocator.POOL_MIN_BYTES


OPS_PER_ROUND = 20


def mixed_round(mesh, x, w, i):
    """20 dtensor calls, one of them a redistribute (an all-to-all or an all-gather,
    alternately; collectives are slow on oversubscribed CI machines), the rest local ops
    and views. Returns two results to check."""
    y = x.redistribute(mesh, [S(1)] if i % 2 else [R])  # 1
    z = ((y * 2.0 + 1.0).relu() - 0.5).abs()  # 5
    m = (x @ w).neg()  # 7: S(0) @ R -> S(0), local
    r = m.sum(dim=1, keepdim=True) + m.amax(dim=1, keepdim=True)  # 10
    q = dt.maximum(m, r).tanh().clamp(max=0.5)  # 13
    v = z.T.contiguous()[:, : COLS // 2]  # 16: views and a copy
    u = dt.DTensor.from_local(v.to_local() * 1.0, mesh, v.placements, shape=v.shape)  # 18
    return q.mean(dim=0), u.sum()  # 20


@pytest.mark.mpi(min_size=1)
def test_10000_ops_leave_allocator_stats_at_baseline(mesh):
    a, b = data((ROWS, COLS), 1), data((COLS, COLS), 2)
    x = dt.distribute_tensor(a, mesh, [S(0)])
    w = dt.distribute_tensor(b, mesh, [R])
    m = -(a @ b)
    expect_q = np.minimum(
        np.tanh(np.maximum(m, m.sum(1, keepdims=True) + m.max(1, keepdims=True))), 0.5
    )
    expect_u = np.abs(np.maximum(a * 2.0 + 1.0, 0) - 0.5).T[:, : COLS // 2].sum()
    base = stats()
    rounds = 10_000 // OPS_PER_ROUND
    for i in range(rounds):
        q, u = mixed_round(mesh, x, w, i)
        if i % 100 == 0:  # results stay right all along
            np.testing.assert_allclose(q.full_tensor().numpy(), expect_q.mean(0), rtol=1e-5)
            np.testing.assert_allclose(u.full_tensor().numpy(), expect_u, rtol=1e-5)
        del q, u
    after = stats()
    assert after["allocated_bytes"] == base["allocated_bytes"], (base, after)
    assert after["active_blocks"] == base["active_blocks"], (base, after)
    assert after["num_allocs"] - base["num_allocs"] == after["num_frees"] - base["num_frees"]
    assert after["num_allocs"] - base["num_allocs"] >= rounds  # the pool was exercised
    np.testing.assert_array_equal(x.full_tensor().numpy(), a)  # inputs unchanged


@pytest.mark.mpi(min_size=1)
def test_steady_loop_does_not_grow_reserved_memory(mesh):
    a, b = data((ROWS, COLS), 3), data((COLS, COLS), 4)
    x = dt.distribute_tensor(a, mesh, [S(0)])
    w = dt.distribute_tensor(b, mesh, [R])
    for i in range(10):  # warm up: the pool reaches its working set
        mixed_round(mesh, x, w, i)
    warm = stats()
    for i in range(100):
        mixed_round(mesh, x, w, i)
        if i % 25 == 0:
            now = stats()
            assert now["reserved_bytes"] == warm["reserved_bytes"], (i, warm, now)
    end = stats()
    assert end["reserved_bytes"] == warm["reserved_bytes"]
    assert end["num_segment_allocs"] == warm["num_segment_allocs"]  # no new segment
    assert end["cache_hits"] - warm["cache_hits"] >= 100  # freed blocks were reused
    assert end["allocated_bytes"] == warm["allocated_bytes"]


@pytest.mark.mpi(min_size=1)
def test_failed_ops_do_not_leak(mesh):
    x = dt.distribute_tensor(data((ROWS, COLS), 5), mesh, [S(0)])
    bad = dt.distribute_tensor(data((COLS, 3), 6), mesh, [R])
    base = stats()
    for _ in range(200):
        with pytest.raises(ShardingError):
            x.redistribute(mesh, [S(1)]) + bad  # redistributes, then the shapes fail
        with pytest.raises(ShardingError):
            x.add_(bad)
    after = stats()
    assert after["allocated_bytes"] == base["allocated_bytes"], (base, after)
    assert after["active_blocks"] == base["active_blocks"]


@pytest.mark.mpi(min_size=1)
def test_views_keep_storage_alive(mesh):
    a = data((ROWS, COLS), 7)
    base = stats()
    x = dt.distribute_tensor(a, mesh, [S(0)])
    held = stats()["allocated_bytes"] - base["allocated_bytes"]
    assert held > 0  # the shard is pooled
    local = x.to_local()
    view = local.T[::2]  # a strided view of the shard
    dview = x.T  # a DTensor view
    expect_local = local.numpy().T[::2].copy()
    del x, local
    assert stats()["allocated_bytes"] - base["allocated_bytes"] == held  # still alive
    np.testing.assert_array_equal(view.numpy(), expect_local)
    np.testing.assert_array_equal(dview.full_tensor().numpy(), a.T)
    # a write through one view is seen through the other (same storage)
    other = dview.to_local()
    other[0, 0] = 123.0
    assert view[0, 0].item() == 123.0
    del dview, other
    assert stats()["allocated_bytes"] - base["allocated_bytes"] == held
    del view
    assert stats()["allocated_bytes"] == base["allocated_bytes"]
